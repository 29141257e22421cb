#!/usr/bin/env bash
# Session 18, third call (one GPU): MXFP8 along dim 0 without the transposed copy (tib2d's q/k X for wgrad) - its GPU
# tests, then end to end in CUDA graphs, 1b bf16/tib2d and 3b bf16/tib2d. The second call's limits (170 s for 1b)
# were too short for a fresh machine's compiles: tib2d's 1b run did not finish.
#   bash scripts/gpu/call_x2.sh COMMIT 585 'bash scripts/gpu/columns_e2e.sh COMMIT'
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 60 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels.py \
  -k "column_kernels and mxfp8 or seed_from_the_device and 3" > $OUT/pytest_columns.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_columns.log)"; grep -E "PASSED|FAILED|^E " $OUT/pytest_columns.log | cut -c1-160 | head -12
source scripts/gpu/ro.sh
ro 1b bf16,tib2d 270
ro 3b bf16,tib2d $(( $(LEFT) - 5 ))
