#!/usr/bin/env bash
# Written in session 19 for the next device call (one GPU; not yet run).
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/fold_calls_3b.sh COMMIT'
# 1. bench/fold_calls.py: the fused Hadamard fold on the calls of AdaHOP's own 1b step, both butterfly forms and
#    every launch per call (the sweep's 16384 x 8192 BF16 tensor chose a table that lost end to end in session 19).
# 2. AdaHOP end to end in CUDA graphs at 3b with permutes (session 19's 3b run had the slow sums; a fresh machine
#    needs more than 270 s for BF16 and AdaHOP at 3b).
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 200 python3 bench/fold_calls.py --model 1b --recipe adahop --hadamard-only --json $OUT/fold_calls-1b-adahop-NVIDIA_H200-$C.json \
  > $OUT/fold_calls.log 2>&1
echo "fold_calls rc $?"; grep -v -E "USDT|Warning" $OUT/fold_calls.log | tail -8
source scripts/gpu/ro.sh
ro 3b bf16,adahop $(( $(LEFT) - 5 ))
