#!/bin/bash
cd "$(dirname "$0")"
r() { echo "=== $1"; ./run1.sh "$@" 2>&1 | grep -E "gate verdict|\[FAIL\]|\[!!\]|error|Traceback|gate rc|TRUTH|step [0-9]|initial|logged loss wrong|RUN FAILED"; }
r pp_gpipe_clean 2 pp_run.py --schedule gpipe --mask 0
r pp_1f1b_clean_clip 2 pp_run.py --schedule 1f1b --micro 3 --clip 0.5 --mask 0 --micro 3
r pp_mb_mean_no_scale 2 pp_run.py --schedule gpipe --fault mb_mean_no_scale --mask 0
r pp_no_zero_grad 2 pp_run.py --schedule 1f1b --fault no_zero_grad --mask 0
r pp_local_clip 2 pp_run.py --schedule gpipe --fault local_clip --clip 0.5 --mask 0
r td_clean 4 tp_run.py --dp 2 --tp 2
r td_dp_own_count 4 tp_run.py --dp 2 --tp 2 --fault dp_own_count
r td_dp_same_data 4 tp_run.py --dp 2 --tp 2 --fault dp_same_data
r tp_init_after_tp 2 tp_run.py --tp 2 --fault init_after_tp --init build_model_titan
