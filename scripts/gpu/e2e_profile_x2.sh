#!/usr/bin/env bash
# Issue #5 on the two-GPU machine, in one call:
#   GPU 0: the end-to-end benchmark (bench/train_speed.py: MODEL, sequence 2048, BATCH, RECIPES, compile);
#   GPU 1: GPU tests (GPU_TESTS, tracebacks kept), then one profiled training step of 1b per
#          PROFILE recipe (bench/profile_step.py, compile, the triton backend): which kernels take the time.
#   bash scripts/gpu/e2e_profile_x2.sh COMMIT SECONDS MODEL BATCH RECIPES
set -u
T0=$(date +%s)
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
left() { echo $(( $1 - 15 - $(date +%s) + T0 )); }
(
  CUDA_VISIBLE_DEVICES=0 timeout $(left $2) python3 bench/train_speed.py --model $3 --seq-len 2048 --batch-size $4 \
    --compile --recipes $5 --warmup 3 --steps 8 --json $OUT/train_speed-$3.json 2>&1 | grep -v USDT > $OUT/train_speed-$3.log
) &
export CUDA_VISIBLE_DEVICES=1
timeout ${TEST_S:-200} python3 -m pytest -v --tb=short -p no:cacheprovider ${GPU_TESTS:-tests/test_cuda.py} > $OUT/pytest_gpu.log 2>&1
echo "== tests: $(grep -c PASSED $OUT/pytest_gpu.log) passed, $(grep -c -E ' FAILED| ERROR' $OUT/pytest_gpu.log) failed"
timeout $(left $2) python3 bench/profile_step.py --model 1b --batch-size 8 --seq-len 2048 --compile --numerics triton \
  --recipes ${PROFILE:-mxfp4,tib2d} --top 25 --json $OUT/profile_1b.json > $OUT/profile_1b.log 2>&1
wait
grep -v USDT $OUT/train_speed-$3.log | tail -12
echo "device seconds used by this call: $(( $(date +%s) - T0 ))"
