#!/usr/bin/env bash
# Session 19, last call: the fused Hadamard fold's launch table from the sweep (FOLD_LAUNCH_HADAMARD: sums along
# dim 1, permutes along dim 0) - AdaHOP end to end in CUDA graphs at 1b against BF16 in the same run.
#   bash scripts/gpu/call_x2.sh COMMIT 280 'bash scripts/gpu/hadamard_launch_1b.sh COMMIT'
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
source scripts/gpu/ro.sh
ro 1b bf16,adahop $(( $(LEFT) - 3 ))
