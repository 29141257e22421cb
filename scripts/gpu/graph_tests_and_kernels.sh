#!/usr/bin/env bash
# One short H200 call: the GPU tests of CUDA-graph capture (an AdaHOP outlier-extraction layer on both backends)
# and of the graph op with device seeds, then the quantize benchmark and the linear-layer benchmark (tib2d,
# mxfp4) at the kernel launches chosen by the session-16 sweep.
#   bash scripts/gpu/graph_tests_and_kernels.sh COMMIT SECONDS
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
T0=$(date +%s)
timeout 110 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_cuda.py tests/test_graph_op.py \
  -k "cuda_graph or device_seeds or seed_output" > $OUT/pytest_graph.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_graph.log)"; grep -E "^E |FAILED" $OUT/pytest_graph.log | cut -c1-200 | head -10
timeout 70 python3 bench/quantize_speed.py --json $OUT/quantize_speed-NVIDIA_H200-$1.json > $OUT/quantize_speed.log 2>&1
echo "quantize rc $?"; grep -E "copy|mxfp4|GB/s" $OUT/quantize_speed.log | cut -c1-160 | head -14
timeout $(( $2 - $(date +%s) + T0 )) python3 bench/linear_speed.py --variants tib2d:triton:triton,mxfp4:triton:triton \
  --json $OUT/linear_speed-NVIDIA_H200-$1.json > $OUT/linear_speed.log 2>&1
echo "linear rc $?"; grep -E "8b" $OUT/linear_speed.log | cut -c1-200
