#!/bin/bash
# NOT FIXED: TP-only loss x TP: named '= W = K (W = 2 ranks)' and layout 'the world size 2'; the TP size is the cause (one replica)
cd "$(dirname "$0")/.." && ./run1.sh tp_loss_x_tp 2 tp_run.py --tp 2 --fault loss_x_tp
