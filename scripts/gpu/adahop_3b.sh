#!/usr/bin/env bash
# Written in session 19 for a device call of its own (one GPU; not yet run): AdaHOP end to end in CUDA graphs at 3b
# with the fold's permutes (session 19's only finished 3b run had the slow sums). A fresh machine needs more than
# 270 s for BF16 and AdaHOP at 3b (session 19's attempt was cut there), so the whole call goes to it.
#   bash scripts/gpu/call_x2.sh COMMIT 560 'bash scripts/gpu/adahop_3b.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
source scripts/gpu/ro.sh
ro 3b bf16,adahop $(( $(LEFT) - 5 ))
