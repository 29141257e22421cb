#!/usr/bin/env bash
# Issue #5 on the two-GPU machine, in one call:
#   GPU 0: the end-to-end benchmark (bench/train_speed.py: MODEL, sequence 2048, BATCH, RECIPES, compile;
#          BACKEND, default the recipes' "auto" = triton);
#   GPU 1: GPU tests (GPU_TESTS, tracebacks kept), then the fold-kernel launch sweep (bench/fold_sweep.py),
#          the quantize benchmark (bench/quantize_speed.py) and the linear-layer benchmark (bench/linear_speed.py).
#   bash scripts/gpu/e2e_sweep_x2.sh COMMIT SECONDS MODEL BATCH RECIPES
set -u
T0=$(date +%s)
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
left() { echo $(( $1 - 15 - $(date +%s) + T0 )); }
TAG=$3${BACKEND:+-$BACKEND}
(
  CUDA_VISIBLE_DEVICES=0 timeout $(left $2) python3 bench/train_speed.py --model $3 --seq-len 2048 --batch-size $4 \
    --compile --recipes $5 ${BACKEND:+--backend $BACKEND} --warmup 3 --steps 8 --json $OUT/train_speed-$TAG.json 2>&1 \
    | grep -v USDT > $OUT/train_speed-$TAG.log
) &
export CUDA_VISIBLE_DEVICES=1
timeout ${TEST_S:-150} python3 -m pytest -v --tb=short -p no:cacheprovider ${GPU_TESTS:-tests/test_cuda.py tests/test_fp8_blockwise.py \
  tests/test_shared_input.py tests/test_kernels.py -k "fold or amax or nvfp4 or fp8 or cuda or blockwise or shared"} \
  > $OUT/pytest_gpu.log 2>&1
echo "== tests: $(grep -c PASSED $OUT/pytest_gpu.log) passed, $(grep -c -E ' FAILED| ERROR' $OUT/pytest_gpu.log) failed"
grep -E " FAILED| ERROR|^E " $OUT/pytest_gpu.log | cut -c1-200 | head -20
timeout 100 python3 bench/fold_sweep.py --json $OUT/fold_sweep.json > $OUT/fold_sweep.log 2>&1
timeout 60 python3 bench/quantize_speed.py --json $OUT/quantize_speed.json > $OUT/quantize_speed.log 2>&1
timeout $(left $2) python3 bench/linear_speed.py --json $OUT/linear_speed.json > $OUT/linear_speed.log 2>&1
wait
grep best $OUT/fold_sweep.log; grep -E "copy|fp8|nvfp4" $OUT/quantize_speed.log; grep 8b $OUT/linear_speed.log | cut -c1-220
tail -8 $OUT/train_speed-$TAG.log
echo "device seconds used by this call: $(( $(date +%s) - T0 ))"
