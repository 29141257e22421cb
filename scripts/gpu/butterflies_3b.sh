#!/usr/bin/env bash
# Session 19, after adahop_regression.sh: the fused Hadamard fold's butterflies are permutes again by default
# (butterfly="sums" on request). Its GPU tests (both forms, both axes), AdaHOP end to end in CUDA graphs at 3b
# (not run with permutes since the capture fixes), the launch sweep of both forms along both dims, and, if time
# is left, AdaHOP at 1b in CUDA graphs at this commit.
#   bash scripts/gpu/call_x2.sh COMMIT 560 'bash scripts/gpu/butterflies_3b.sh COMMIT'
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 90 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels.py -k "fused_hadamard or along_dim_0_reads" \
  > $OUT/pytest_butterflies.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_butterflies.log)"; grep -E "FAILED|^E " $OUT/pytest_butterflies.log | cut -c1-160 | head -8
source scripts/gpu/ro.sh
ro 3b bf16,adahop 270
timeout $(( $(LEFT) > 200 ? 170 : $(LEFT) - 5 )) python3 bench/fold_sweep.py --kernels hadamard --json $OUT/fold_sweep-hadamard-$C.json \
  > $OUT/fold_sweep.log 2>&1; grep best $OUT/fold_sweep.log
[ $(LEFT) -gt 100 ] && ro 1b bf16,adahop $(( $(LEFT) - 5 ))
