#!/usr/bin/env bash
# Issue #5's end-to-end benchmark on one H200: tokens/s and peak memory of every recipe at one
# model size, sequence 2048, torch.compile on, the same batch for all (BF16 first, in the same
# run), fp4train's default backend on a GPU (triton), torchao's float8 rowwise as the peer.
#   bash scripts/gpu/e2e_speed.sh COMMIT MODEL BATCH [RECIPES]
# A recipe that fails (memory, compile) is recorded with its error; the rest still run.
set -u
# torchao travels as wheels (carry [".whl"]); without them its recipe is recorded with its import error
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
R=${4:-bf16,fp8_rowwise,torchao_fp8_rowwise,mxfp4,hadamard_mxfp4,tib2d,adahop,nvfp4}
timeout 560 python3 bench/train_speed.py --model $2 --seq-len 2048 --batch-size $3 --compile --recipes $R \
  --warmup 3 --steps 8 --json $OUT/train_speed-$2.json 2>&1 | grep -v USDT | tee $OUT/train_speed-$2.log | tail -20
