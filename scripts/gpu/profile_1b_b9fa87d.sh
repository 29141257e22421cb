#!/usr/bin/env bash
# Session 20: where AdaHOP's 1b step spends its time with the fold_calls table, at train_speed's batch (8 x 2048):
# one profiled step of bf16 and adahop under torch.compile (default mode), kernel by kernel.
#   bash scripts/gpu/call_x2.sh COMMIT 350 'bash scripts/gpu/profile_1b_b9fa87d.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
timeout $(( $(LEFT) - 5 )) python3 bench/profile_step.py --model 1b --recipes bf16,adahop --batch-size 8 --seq-len 2048 \
  --compile --top 30 --json $OUT/1b-H200-triton-adahop-8x2048-$C.json > $OUT/profile.log 2>&1
echo "profile rc $?"; grep -E "ms|tokens" $OUT/profile.log | head -70 | cut -c1-200
