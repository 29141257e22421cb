#!/usr/bin/env bash
# One H200 call after kernel work done on the CPU: the GPU tests of the changed kernels (tile, packed fold, fold,
# E2M1 stochastic rounding) first, then the launch sweeps of the operand kernels (the BF16 -> FP8 fold along
# either axis, tib2d's 32x32 tile kernels -- the even/odd-column one and the general one -- and their folds),
# so that the next call's end-to-end run uses the best launches. fold_sweep writes its JSON after every
# launch, so a sweep cut by its time limit keeps what it timed.
#   bash scripts/gpu/kernels_sweep.sh COMMIT     (202 s on the H200 in session 16; its limits add up to 550 s)
# The whole fold and tiles-columns groups (70 s and 43 s there) are left to the next call:
# ONLY="fold tiles-columns" bash scripts/gpu/gpu_tests.sh 150.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
timeout 100 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernels.py \
  -k "usual_path or on_the_grid or stochastic_rounding or fold_of_packed or near_and_general or ties_signs" > $OUT/pytest_changed.log 2>&1
echo "changed-kernel tests rc $?: $(tail -1 $OUT/pytest_changed.log)"; grep -E "^E |FAILED" $OUT/pytest_changed.log | cut -c1-200 | head -20
MAXFAIL=3 ONLY="fold-dim0" bash scripts/gpu/gpu_tests.sh 60
timeout 390 python3 bench/fold_sweep.py --kernels tiles,tile_fold,fold --json $OUT/fold_sweep-$1.json > $OUT/fold_sweep.log 2>&1
echo "fold_sweep rc $?"; grep -E "^best" $OUT/fold_sweep.log
