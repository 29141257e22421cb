#!/usr/bin/env bash
# One call on the two-GPU machine: the comparison's remaining runs on both GPUs (compare_60m.sh),
# and beside them, on GPU 1, every GPU test (the #5 fast path included) - the tests need no
# quiet GPU. If a test of what the remaining runs use fails, the comparison is stopped.
#   bash scripts/gpu/compare_with_tests.sh COMMIT SECONDS
set -u
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
(
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD:/tmp/site timeout $(( $2 - 60 )) python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_cuda.py tests/test_kernels.py tests/test_fp8_blockwise.py tests/test_backends.py \
    tests/test_numerics_modes.py tests/test_fused_operands.py > $OUT/pytest_gpu.log 2>&1
  if grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.log | grep -qiE "nvfp4|fp8_rowwise|e4m3|decode|resume"; then
    echo "a test of what the comparison uses failed: stopping it" >> $OUT/pytest_gpu.log
    pkill -INT -f "fp4train compare"
  fi
) &
SLOTS=${SLOTS:-0,1,0,1} bash scripts/gpu/compare_60m.sh "$1" "$2"
wait
echo "== GPU tests"; tail -25 $OUT/pytest_gpu.log
