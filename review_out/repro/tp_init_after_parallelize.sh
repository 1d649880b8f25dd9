#!/bin/bash
# TP init after parallelize_module (each shard drawn from the same seed): refused with 'seed it as the loop does' before the fix (now names the copied shards)
cd "$(dirname "$0")/.." && ./run1.sh tp_init_after_tp 2 tp_run.py --tp 2 --fault init_after_tp --init build_model_titan
