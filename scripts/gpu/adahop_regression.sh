#!/usr/bin/env bash
# Session 19: AdaHOP in CUDA graphs at 1b ran at 0.79x BF16 at a6adc54 (269.6 ms a step) against 1.03x at 21ffa9f
# (200.9 ms). Where did the time go? One profiled step under torch.compile (default mode) at this commit, then the
# same with the fused Hadamard fold's butterflies back to permutes (kernels/hadamard._butterfly, as before 5bf76a2's
# follow-up), in a copy of the tree; then, if time is left, that copy end to end in CUDA graphs.
# As it ran (session 19), the profiles took profile_step's default batch, 32 x 1024 tokens (twice train_speed's 8 x 2048).
#   bash scripts/gpu/call_x2.sh COMMIT 560 'bash scripts/gpu/adahop_regression.sh COMMIT'
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
prof() {  # tree, recipes, json name, seconds
  (cd $1 && PYTHONPATH=$1 timeout $4 python3 bench/profile_step.py --model 1b --recipes $2 --compile --top 30 \
     --json $OUT/$3.json > $OUT/$3.log 2>&1; echo "$3 rc $?")
  grep -E "ms|tokens" $OUT/$3.log | head -40 | cut -c1-200
}
prof $PWD bf16,adahop 1b-H200-triton-adahop-$C 200
rm -rf /tmp/alt && mkdir /tmp/alt && cp -r fp4train bench scripts /tmp/alt/
sed -i 's/_butterfly_sums(y, NB, HAD/_butterfly(y, NB, HAD/; s/from .hadamard import _butterfly_sums/from .hadamard import _butterfly/' /tmp/alt/fp4train/kernels/mx_fold.py
grep -n "_butterfly" /tmp/alt/fp4train/kernels/mx_fold.py
prof /tmp/alt adahop 1b-H200-triton-adahop-permutes-$C 170
[ $(LEFT) -gt 120 ] && (cd /tmp/alt && PYTHONPATH=/tmp/alt C=$C-permutes OUT=$OUT bash -c 'source scripts/gpu/ro.sh; ro 1b adahop $(( '$(LEFT)' - 5 ))')
