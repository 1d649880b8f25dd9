#!/bin/bash
# NOT FIXED: a hand-written all-reduce AVG (should be SUM) of a sequence-parallel norm's gradients: FAIL, but 'not by a constant factor' (the two tensors are exactly x 1/TP)
cd "$(dirname "$0")/.." && ./run1.sh tp_sp_norm_avg 2 tp_run.py --tp 2 --fault sp_norm_avg
