#!/usr/bin/env bash
# One H200 call: the GPU tests of code changed since the last GPU run (the rewritten NVFP4 16x16 tile
# kernel, the fold along dim 0, the triton-vs-emulated layer test, the numerics test that was cut),
# then a kernel-by-kernel profile of one compiled 1b step under the fast path (triton numerics).
#   bash scripts/gpu/verify_and_profile.sh COMMIT [PROFILE_SECONDS] [RECIPES]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
P=${2:-260}
R=${3:-bf16,tib2d,adahop}
MAXFAIL=3 ONLY="tiles-columns fold-dim0" bash scripts/gpu/gpu_tests.sh 100
timeout 100 python3 -m pytest -q --tb=short -p no:cacheprovider \
  "tests/test_cuda.py::test_gpu_triton_backend_layer_matches_the_emulated_backend" \
  tests/test_numerics_modes.py -k "triton_backend_layer or cpu_tensors_take" > $OUT/pytest_layer.log 2>&1
tail -1 $OUT/pytest_layer.log; grep -E "^E |FAILED" $OUT/pytest_layer.log | cut -c1-200 | head -20
timeout $P python3 bench/profile_step.py --model 1b --seq-len 2048 --batch-size 8 --compile --recipes $R \
  --json $OUT/profile-1b-$1.json > $OUT/profile-1b.log 2>&1
echo "profile rc $?"; grep -E "^==|total|step" $OUT/profile-1b.log | head -20
