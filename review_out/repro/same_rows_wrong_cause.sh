#!/bin/bash
# 2-D dp2 x tp2, both replicas read the same rows, the count from the intended rows: the gradient was named 'the mean of the ranks' own token means x 0.9444' with 'steps hold 56, 56 targets' before the fixes (now: per-step scalars, divided by 36, 46 where the steps hold 34, 44)
cd "$(dirname "$0")/.." && ./run1.sh td_dp_same_data 4 tp_run.py --dp 2 --tp 2 --fault dp_same_data
