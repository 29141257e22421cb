#!/usr/bin/env bash
# Written in session 19 for the next device call (one GPU; not yet run). Then scripts/gpu/adahop_3b.sh in a second call.
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/pairs_and_fold_calls.sh COMMIT'
# 1. The MXFP4 row kernel by even/odd elements (quantize_mxfp4(pairs=True)): its GPU tests, then bench/quantize_speed.py
#    (rows "triton mxfp4 nearest/stochastic (even/odd)" against "triton mxfp4 nearest/stochastic").
# 2. bench/fold_calls.py: the fused Hadamard fold on the calls of AdaHOP's own 1b step, both butterfly forms and every
#    launch per call (the sweep's 16384 x 8192 BF16 tensor chose a table that lost end to end in session 19).
# 3. If time is left: the 1D launch sweep with the even/odd kernel (fold_sweep --kernels mx1d).
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
timeout 150 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels.py \
  -k "test_mxfp4_kernel_equals_reference or take_the_seed_from_the_device" > $OUT/pytest_pairs.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_pairs.log)"; grep -E "FAILED|^E " $OUT/pytest_pairs.log | cut -c1-160 | head -8
timeout 120 python3 bench/quantize_speed.py --json $OUT/quantize_speed-NVIDIA_H200-$C.json > $OUT/quantize_speed.log 2>&1
echo "quantize rc $?"; grep -E "copy|triton mxfp4 (nearest|stochastic)" $OUT/quantize_speed.log
timeout $(( $(LEFT) > 240 ? 220 : $(LEFT) - 5 )) python3 bench/fold_calls.py --model 1b --recipe adahop --hadamard-only \
  --json $OUT/fold_calls-1b-adahop-NVIDIA_H200-$C.json > $OUT/fold_calls.log 2>&1
echo "fold_calls rc $?"; grep -v -E "USDT|Warning" $OUT/fold_calls.log | tail -8
[ $(LEFT) -gt 60 ] && timeout $(( $(LEFT) - 5 )) python3 bench/fold_sweep.py --kernels mx1d --json $OUT/fold_sweep-mx1d-$C.json \
  > $OUT/fold_sweep.log 2>&1; grep best $OUT/fold_sweep.log
