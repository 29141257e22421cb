#!/usr/bin/env bash
# One H200 call for the CUDA-graph path: the GPU tests of the stochastic-rounding kernels that read their keys
# from the device, of the one-launch seed kernels, of the graph op with device seeds and of an AdaHOP
# outlier-extraction layer captured in a CUDA graph; then the 1b end-to-end run of bf16, tib2d, adahop and mxfp4
# compiled with mode="reduce-overhead" (each recipe's cudagraph_skips should be 0), then a short run of the
# trainer itself with --compile-mode reduce-overhead on tiny.
#   bash scripts/gpu/cudagraphs.sh COMMIT     (limits add up to 580 s)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernels.py tests/test_graph_op.py tests/test_cuda.py \
  -k "take_the_seed_from_the_device or seed_kernels or device_seeds or seed_output or backend_state or cuda_graph" \
  > $OUT/pytest_cudagraphs.log 2>&1
echo "device-seed tests rc $?: $(tail -1 $OUT/pytest_cudagraphs.log)"; grep -E "^E |FAILED" $OUT/pytest_cudagraphs.log | cut -c1-200 | head -10
timeout 370 python3 bench/train_speed.py --model 1b --seq-len 2048 --batch-size 8 --compile --compile-mode reduce-overhead \
  --recipes bf16,tib2d,adahop,mxfp4 --warmup 3 --steps 8 --json $OUT/train_speed-1b-reduce-overhead-$1.json > $OUT/train_speed_ro.log 2>&1
echo "e2e rc $?"; grep -E "tokens/s|FAILED|skipping cudagraphs" $OUT/train_speed_ro.log | cut -c1-300 | head -12
timeout 60 python3 -m fp4train train --model tiny --recipe tib2d --max-steps 30 --seq-len 128 --batch-size 8 --compile \
  --compile-mode reduce-overhead --eval-every 15 --no-progress --no-tensorboard --out $OUT/train_ro > $OUT/train_ro.log 2>&1
echo "trainer rc $?"; tail -4 $OUT/train_ro.log | cut -c1-200
