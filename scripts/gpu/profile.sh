#!/usr/bin/env bash
# Profile one training step per recipe on a 2x H200 device machine (bench/profile_step.py),
# GPU 0 and GPU 1 in parallel, after the CUDA tests. Usage: bash scripts/gpu/profile.sh COMMIT
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
A=${A:-bf16,fp8_rowwise,mxfp4,nvfp4}
B=${B:-hadamard_mxfp4,tib2d,adahop}
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_compiled_numerics.py tests/test_backends.py > $OUT/pytest.log 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/profile_step.py --recipes $A --numerics compiled --json $OUT/profile_a.json > $OUT/profile_a.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 330 python3 bench/profile_step.py --recipes $B --numerics compiled --json $OUT/profile_b.json > $OUT/profile_b.log 2>&1;
 CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/profile_step.py --recipes mxfp4,tib2d --numerics triton --json $OUT/profile_c.json > $OUT/profile_c.log 2>&1) &
wait
tail -3 $OUT/pytest.log; grep -h "==\|Error" $OUT/profile_*.log
