#!/usr/bin/env bash
# Written in session 18 for the next device call (one GPU; not yet run): what session 18 changed without timing it.
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/next_session.sh COMMIT'
# 1. The fused Hadamard fold with butterflies by sums (kernels/hadamard._butterfly_sums): its GPU tests, then
#    bench/quantize_speed.py ("hadamard 32 + mxfp4 -> fp8 1x128 (fused)": 0.638 ms at e19dc98 with permutes) and a
#    sweep of its launch (bench/fold_sweep.py --kernels hadamard), since it now needs half the registers.
# 2. AdaHOP end to end in CUDA graphs at 1b (1.03x at 21ffa9f; its IHT GEMMs use that fold) and 3b (not run since
#    the capture fixes). A fresh machine compiles for minutes: give each run at least 250 s.
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 60 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels.py -k "fused_hadamard" > $OUT/pytest_hadamard.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_hadamard.log)"; grep -E "FAILED|^E " $OUT/pytest_hadamard.log | cut -c1-160 | head -8
timeout 100 python3 bench/quantize_speed.py --json $OUT/quantize_speed-NVIDIA_H200-$C.json > $OUT/quantize_speed.log 2>&1
echo "quantize rc $?"; grep -E "copy|hadamard|-> fp8" $OUT/quantize_speed.log
source scripts/gpu/ro.sh
ro 1b bf16,adahop 260
ro 3b bf16,adahop $(( $(LEFT) - 5 ))
# if time is left after both runs: the launch sweep of the Hadamard fold
[ $(LEFT) -gt 60 ] && timeout $(( $(LEFT) - 5 )) python3 bench/fold_sweep.py --kernels hadamard --json $OUT/fold_sweep-hadamard-$C.json \
  > $OUT/fold_sweep.log 2>&1; tail -3 $OUT/fold_sweep.log
