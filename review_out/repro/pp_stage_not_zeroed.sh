#!/bin/bash
# pipeline stage 1 never zeroes its gradients: 'not by a constant factor' before the fix (now: not zeroed, x 0.5 = 1/K of the step before)
cd "$(dirname "$0")/.." && ./run1.sh pp_no_zero_grad 2 pp_run.py --schedule 1f1b --fault no_zero_grad --mask 0
