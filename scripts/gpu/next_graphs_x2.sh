#!/usr/bin/env bash
# The next call on the two-GPU machine (written in session 17, not yet run): what session 17 left unmeasured.
#   GPU 0: the GPU tests of the graph op with device seeds that the earlier calls' limits cut (they compile models,
#          ~30-50 s each), the AdaHOP capture test, the seed kernels; then bench/profile_step.py at 1b for tib2d
#          with --copies (where its 272 ATen elementwise launches a step, 8.9 ms at 3e2df64, come from).
#   GPU 1: AdaHOP at 3b in CUDA graphs (not rerun after the capture fixes), then 1b in CUDA graphs for bf16 and
#          nvfp4 (its random Hadamard signs now come from the device seed: cudagraph_skips should be 0).
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/next_graphs_x2.sh 0 COMMIT' 'bash scripts/gpu/next_graphs_x2.sh 1 COMMIT'
# Left for a later call: bench/memory_peak.py at 1b for bf16 beside mxfp4 (the memory target's arithmetic, LOG).
set -u
G=$1 C=$2
LEFT() { echo $(( DEADLINE - $(date +%s) )); }  # seconds to call_x2.sh's deadline (DEADLINE is exported there)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
ro() {  # model recipes seconds
  timeout $3 python3 bench/train_speed.py --model $1 --seq-len 2048 --batch-size 8 --compile --compile-mode reduce-overhead \
    --recipes $2 --warmup 3 --steps 8 --json $OUT/train_speed-$1-reduce-overhead-$C-gpu$G.json > $OUT/train_speed_ro-$1-gpu$G.log 2>&1
  echo "$1 rc $?"; grep -E "tokens/s|FAILED" $OUT/train_speed_ro-$1-gpu$G.log | cut -c1-300
}
if [ "$G" = 0 ]; then
  timeout 300 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_graph_op.py tests/test_cuda.py tests/test_kernels.py \
    -k "device_seeds or seed_output or backend_state or cuda_graph or seed_kernels" > $OUT/pytest_graphs.log 2>&1
  echo "tests rc $?: $(tail -1 $OUT/pytest_graphs.log)"; grep -E " FAILED|^E " $OUT/pytest_graphs.log | cut -c1-200 | head -10
  timeout $(( $(LEFT) - 5 )) python3 bench/profile_step.py --model 1b --seq-len 2048 --batch-size 8 --compile --recipes bf16,tib2d \
    --copies 20 --json $OUT/profile_step-1b-H200-copies-$C.json > $OUT/profile_copies.log 2>&1
  echo "profile rc $?"; grep -E "^== |copy " $OUT/profile_copies.log | cut -c1-220 | head -30
else
  ro 3b bf16,adahop 380
  ro 1b bf16,nvfp4 $(( $(LEFT) - 5 ))
fi
