#!/usr/bin/env bash
# Session 20: bench/fold_calls.py on AdaHOP's 1b step alone (session 20's first call gave it 220 s, which ended
# after recording, inside the compiles). Now it prints and writes each call as it is timed, and along dim 0
# tries permutes only.
#   bash scripts/gpu/call_x2.sh COMMIT 480 'bash scripts/gpu/fold_calls_1b.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
T=$(date +%s)
timeout $(( $(LEFT) - 5 )) python3 bench/fold_calls.py --model 1b --recipe adahop --hadamard-only \
  --json $OUT/fold_calls-1b-adahop-NVIDIA_H200-$C.json > $OUT/fold_calls.log 2>&1
echo "fold_calls rc $? after $(( $(date +%s) - T )) s"; grep -v -E "USDT|Warning" $OUT/fold_calls.log | tail -22 | cut -c1-220
