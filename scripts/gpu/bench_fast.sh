#!/usr/bin/env bash
# Issue #5 on one H200: the GPU tests of the fast path first (the benchmarks run only if they
# pass), then the kernel, GEMM and linear-layer benchmarks, each measuring its BF16 / copy
# baseline itself. JSON + logs land in $OUT; copy the JSON into bench/results/.
#   bash scripts/gpu/bench_fast.sh COMMIT
set -u
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fp8_blockwise.py tests/test_kernels.py \
  tests/test_backends.py tests/test_cuda.py > $OUT/pytest_fast.log 2>&1
tail -3 $OUT/pytest_fast.log
grep -q " passed" $OUT/pytest_fast.log && ! grep -q -E "^(FAILED|ERROR)" $OUT/pytest_fast.log || { echo "GPU tests failed: no benchmarks"; exit 1; }
timeout 90 python3 bench/quantize_speed.py --json $OUT/quantize_speed.json > $OUT/quantize_speed.log 2>&1
timeout 150 python3 bench/gemm_speed.py --json $OUT/gemm_speed.json > $OUT/gemm_speed.log 2>&1
timeout 150 python3 bench/linear_speed.py --json $OUT/linear_speed.json > $OUT/linear_speed.log 2>&1
cat $OUT/quantize_speed.log $OUT/gemm_speed.log $OUT/linear_speed.log | grep -v USDT | tail -45
