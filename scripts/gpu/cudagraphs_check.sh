#!/usr/bin/env bash
# One H200 call after the CUDA-graph fixes: the GPU tests of the one-launch seed kernels and of an AdaHOP
# outlier-extraction layer captured in a CUDA graph (emulated and triton backends), then with
# mode="reduce-overhead" the 1b run of bf16 and adahop and the 3b run of bf16 and tib2d (device seeds).
#   bash scripts/gpu/cudagraphs_check.sh COMMIT     (limits add up to 580 s)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
T0=$(date +%s)
timeout 100 python3 -m pytest -q --tb=short -p no:cacheprovider "tests/test_kernels.py::test_seed_kernels_derive_the_reference_seeds_and_keys_bit_for_bit" \
  tests/test_cuda.py -k "seed_kernels or cuda_graph" > $OUT/pytest_graph_fixes.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_graph_fixes.log)"; grep -E "^E |FAILED" $OUT/pytest_graph_fixes.log | cut -c1-200 | head -10
run() {  # model recipes seconds
  timeout $3 python3 bench/train_speed.py --model $1 --seq-len 2048 --batch-size 8 --compile --compile-mode reduce-overhead \
    --recipes $2 --warmup 3 --steps 8 --json $OUT/train_speed-$1-reduce-overhead-$FP4TRAIN_COMMIT.json > $OUT/train_speed_ro-$1.log 2>&1
  echo "$1 rc $?"; grep -E "tokens/s|FAILED" $OUT/train_speed_ro-$1.log | cut -c1-300
}
run 1b bf16,adahop 220
run 3b bf16,tib2d $(( 580 - $(date +%s) + T0 ))
