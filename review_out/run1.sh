#!/bin/bash
# run1.sh NAME NPROC SCRIPT ARGS... : run one loop, its gate check and its truth; print both.
cd "$(dirname "$0")" && source /work/venv/bin/activate
export PYTHONPATH=$(cd .. && pwd):$(pwd) OMP_NUM_THREADS=1
name=$1; n=$2; script=$3; shift 3
rm -rf runs/$name runs/${name}_truth; mkdir -p runs logs
timeout 300 torchrun --standalone --nproc_per_node=$n $script --out runs/$name "$@" > logs/$name.run.log 2>&1 || { echo "RUN FAILED rc=$?"; tail -5 logs/$name.run.log; }
timeout 300 python -m dormouse gate check --out runs/$name > logs/$name.gate.log 2>&1; echo "gate rc=$?" >> logs/$name.gate.log
cat logs/$name.gate.log
python truth.py runs/$name "$@" | tee logs/$name.truth.log
