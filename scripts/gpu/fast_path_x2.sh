#!/usr/bin/env bash
# Issue #5 on the two-GPU machine, in one call:
#   GPU 0: the end-to-end benchmark (bench/train_speed.py: MODEL, sequence 2048, BATCH, RECIPES,
#          torch.compile on; BF16 first, measured in the same run);
#   GPU 1: the GPU tests (GPU_TESTS, each test's result on its own line, so a call cut short still
#          says which ran), then the quantize / GEMM / linear benchmarks (each measures its copy /
#          cuBLAS / nn.Linear baseline itself).
# The two jobs share the host (32 cores), not a GPU. Benchmarks run even when a test fails: the
# test log says which numbers stand on tested code. JSON + logs land in $OUT.
#   bash scripts/gpu/fast_path_x2.sh COMMIT SECONDS MODEL BATCH RECIPES
set -u
T0=$(date +%s)
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
left() { echo $(( $2 - 15 - $(date +%s) + T0 )); }
(
  CUDA_VISIBLE_DEVICES=0 timeout $(left x $2) python3 bench/train_speed.py --model $3 --seq-len 2048 --batch-size $4 \
    --compile --recipes $5 --warmup 3 --steps 8 --json $OUT/train_speed-$3.json 2>&1 | grep -v USDT > $OUT/train_speed-$3.log
) &
export CUDA_VISIBLE_DEVICES=1
timeout ${TEST_S:-280} python3 -m pytest -v --tb=short -p no:cacheprovider ${GPU_TESTS:-tests/test_cuda.py tests/test_kernels.py \
  tests/test_fp8_blockwise.py tests/test_backends.py tests/test_numerics_modes.py} > $OUT/pytest_gpu.log 2>&1
echo "== tests: $(grep -c PASSED $OUT/pytest_gpu.log) passed, $(grep -c -E 'FAILED|ERROR' $OUT/pytest_gpu.log) failed lines"
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.log | cut -c1-200 | head -30
timeout 60 python3 bench/quantize_speed.py --json $OUT/quantize_speed.json > $OUT/quantize_speed.log 2>&1
timeout 90 python3 bench/gemm_speed.py --json $OUT/gemm_speed.json > $OUT/gemm_speed.log 2>&1
timeout $(left x $2) python3 bench/linear_speed.py --json $OUT/linear_speed.json > $OUT/linear_speed.log 2>&1
wait
cat $OUT/quantize_speed.log $OUT/gemm_speed.log $OUT/linear_speed.log $OUT/train_speed-$3.log | grep -v USDT | tail -60
echo "device seconds used by this call: $(( $(date +%s) - T0 ))"
