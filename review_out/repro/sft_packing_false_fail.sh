#!/bin/bash
# a right TRL SFTTrainer(packing=True) run: FAILED the ranks check on TRL's per-batch max_length_q/k before the fix (now PASS)
cd "$(dirname "$0")/.." && ./run1.sh sft_packing 2 hf_run.py --kind sft_pack --build hf_run:build_model
