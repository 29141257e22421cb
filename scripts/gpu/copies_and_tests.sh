#!/usr/bin/env bash
# Session 18, first call (one GPU): where tib2d's ATen copies come from, then the GPU tests that earlier calls' limits cut.
#   bash scripts/gpu/call_x2.sh COMMIT 560 'bash scripts/gpu/copies_and_tests.sh COMMIT'
# 1. bench/profile_step.py at 1b (compiled, default mode) for bf16 and tib2d with --copies 25: the heaviest ATen copies
#    of a step (272 launches, 8.9 ms at 3e2df64), each charged to the fp4train line that asked for it.
# 2. The graph op's device-seed tests, the CUDA-graph tests and the seed kernels on the GPU (they compile models).
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 300 python3 bench/profile_step.py --model 1b --seq-len 2048 --batch-size 8 --compile --recipes bf16,tib2d \
  --copies 25 --json $OUT/profile_step-1b-H200-copies-$C.json > $OUT/profile_copies.log 2>&1
echo "profile rc $?"; grep -E "^== |copy |ms/step" $OUT/profile_copies.log | cut -c1-220 | head -40
timeout $(( $(LEFT) - 5 )) python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_graph_op.py tests/test_cuda.py tests/test_kernels.py \
  -k "device_seeds or seed_output or backend_state or cuda_graph or seed_kernels" > $OUT/pytest_graphs.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_graphs.log)"; grep -E " FAILED|^E " $OUT/pytest_graphs.log | cut -c1-200 | head -10
