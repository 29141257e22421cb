#!/usr/bin/env bash
# One H200 call after kernel work done on the CPU: the GPU tests of the changed kernels (tile, packed fold, fold,
# E2M1 stochastic rounding), then the launch sweep of tib2d's kernels (the even/odd-column tile kernel
# against the general one, and the tile folds), so that the next call's end-to-end run uses the best launch.
#   bash scripts/gpu/kernels_sweep.sh COMMIT [SECONDS_PER_TEST_GROUP]   (about 510 s: under one call's 600)
# The whole fold group (50 tests, 170 s on the H200) does not fit beside the sweep: run it in the next call
# (ONLY=fold bash scripts/gpu/gpu_tests.sh 180).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
S=${2:-90}
MAXFAIL=3 ONLY="tiles-columns fold-dim0" bash scripts/gpu/gpu_tests.sh $S
timeout $S python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernels.py \
  -k "usual_path or on_the_grid or stochastic_rounding or fold_of_packed or near_and_general or ties_signs" > $OUT/pytest_changed.log 2>&1
echo "changed-kernel tests rc $?: $(tail -1 $OUT/pytest_changed.log)"; grep -E "^E |FAILED" $OUT/pytest_changed.log | cut -c1-200 | head -20
timeout 240 python3 bench/fold_sweep.py --kernels tiles,tile_fold --json $OUT/fold_sweep-$1.json > $OUT/fold_sweep.log 2>&1
echo "fold_sweep rc $?"; grep -E "^best" $OUT/fold_sweep.log
