#!/bin/bash
cd "$(dirname "$0")"
r() { echo "=== $1"; ./run1.sh "$@" 2>&1 | grep -E "gate verdict|\[FAIL\]|\[!!\]|error|Traceback|gate rc|TRUTH|step [0-9]|initial|logged loss wrong|RUN FAILED"; }
r lightning_clean 2 lightning_run.py --build fw_common:build_net
r lightning_double_k 2 lightning_run.py --fault double_k --build fw_common:build_net
r accelerate_clean 2 accelerate_run.py --build fw_common:build_net
r accelerate_double_k 2 accelerate_run.py --fault double_k --build fw_common:build_net
r sft_clean 2 hf_run.py --kind sft --build hf_run:build_model
r sft_packing 2 hf_run.py --kind sft_pack --build hf_run:build_model
r sft_lora 2 hf_run.py --kind sft_lora --build hf_run:build_lora
r hf_lora_double_k 2 hf_run.py --kind hf_lora --fault double_k --build hf_run:build_lora
r pp_mb_mean_no_scale_k3 2 pp_run.py --schedule gpipe --fault mb_mean_no_scale --mask 0 --micro 3
