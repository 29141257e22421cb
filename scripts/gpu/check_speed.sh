#!/usr/bin/env bash
# GPU checks after a numerics change, on a 2x H200 device machine: the CUDA tests of the compiled
# path (GPU 0), training-step speed of every recipe (GPU 1), then a kernel profile (GPU 0).
#   bash scripts/gpu/check_speed.sh COMMIT
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused_operands.py \
   tests/test_compiled_numerics.py tests/test_backends.py tests/test_kernels.py tests/test_cuda.py > $OUT/pytest.log 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/profile_step.py --recipes ${P:-mxfp4,nvfp4,hadamard_mxfp4,adahop} --numerics compiled \
   --json $OUT/profile.json > $OUT/profile.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 400 python3 bench/train_speed.py --model 60m --recipes bf16,fp8_rowwise,mxfp4,nvfp4,hadamard_mxfp4,tib2d \
   --batch-size 32 --seq-len 1024 --warmup 4 --steps 10 --numerics compiled --json $OUT/train_speed.json > $OUT/train_speed.log 2>&1) &
wait
tail -3 $OUT/pytest.log; grep -v USDT $OUT/train_speed.log | tail -8; grep -h "==\|Error" $OUT/profile.log
