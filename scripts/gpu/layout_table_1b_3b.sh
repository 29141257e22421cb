#!/usr/bin/env bash
# (Session 21 ran what this does as scripts/gpu/table_and_torchao.sh and inline calls: docs/LOG.md, session 21.)
# Session 20 (written, not run): FOLD_LAUNCH_HADAMARD grouped by reads (block dim strided or not) end to end in CUDA graphs,
# BF16 in the same run: 1b, then 3b with the time left.
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/layout_table_1b_3b.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
source scripts/gpu/ro.sh
ro 1b bf16,adahop 240
ro 3b bf16,adahop $(( $(LEFT) - 5 ))
