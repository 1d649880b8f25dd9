#!/bin/bash
# NOT FIXED: Megatron's vocab-parallel CE on gathered logits (#7452 item 2): loss FAIL alone, right, but the loss's offset + log(TP) = 0.693 is not named
cd "$(dirname "$0")/.." && ./run1.sh tp_gathered_vocab_ce 2 tp_run.py --tp 2 --fault gathered_vocab_ce
