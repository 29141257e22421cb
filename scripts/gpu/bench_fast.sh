#!/usr/bin/env bash
# Issue #5 on a 2x H200 device machine: the GPU tests of the fast path (GPU 0), then the kernel,
# GEMM and linear-layer benchmarks (GPU 1, then GPU 0). Results land in $OUT as JSON + logs.
#   bash scripts/gpu/bench_fast.sh COMMIT
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
(CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_blockwise.py tests/test_kernels.py \
   tests/test_numerics_modes.py tests/test_backends.py > $OUT/pytest.log 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/linear_speed.py --json $OUT/linear_speed.json > $OUT/linear_speed.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/quantize_speed.py --json $OUT/quantize_speed.json > $OUT/quantize_speed.log 2>&1;
 CUDA_VISIBLE_DEVICES=1 timeout 300 python3 bench/gemm_speed.py --json $OUT/gemm_speed.json > $OUT/gemm_speed.log 2>&1) &
wait
tail -3 $OUT/pytest.log; cat $OUT/quantize_speed.log $OUT/gemm_speed.log $OUT/linear_speed.log | grep -v USDT | tail -40
