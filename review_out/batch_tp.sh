#!/bin/bash
cd "$(dirname "$0")"
r() { echo "=== $1"; ./run1.sh "$@" 2>&1 | grep -E "gate verdict|\[FAIL\]|\[!!\]|error|Traceback|gate rc|TRUTH|step [0-9]|initial|logged loss wrong|RUN FAILED"; }
r tp_clean_gather 2 tp_run.py --tp 2 --loss-parallel 0
r tp_sp_norm_local 2 tp_run.py --tp 2 --fault sp_norm_local
r tp_sp_norm_avg 2 tp_run.py --tp 2 --fault sp_norm_avg
r tp_loss_x_tp 2 tp_run.py --tp 2 --fault loss_x_tp
r tp_loss_div_tp 2 tp_run.py --tp 2 --fault loss_div_tp
r tp_vocab47_lp 2 tp_run.py --tp 2 --vocab 47
r tp_gathered_vocab_ce 2 tp_run.py --tp 2 --fault gathered_vocab_ce
