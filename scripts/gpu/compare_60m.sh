#!/usr/bin/env bash
# The 60m enwiki recipe comparison of issues #3/#4 on a 2x H200 device machine, in chunks of at
# most one device call each. Finished runs (summary.json present) already in $CMP are skipped by
# `fp4train compare`, so each call continues where the last stopped; what finished comes back as
# $OUT/runs.tgz (metrics, summaries, calibration tables; no checkpoints) to be unpacked into $CMP.
#
#   bash scripts/gpu/compare_60m.sh COMMIT SECONDS [pytest]
#
# With `pytest`, the GPU tests of the numerics the runs use go first, on GPU 0, while GPU 1 trains
# the BF16 runs (untouched by those numerics); the FP4 runs start only if the tests pass.
# Settings: BF16's learning rate from bench/results/lr_sweep-60m-enwiki (1.2e-3, warmup 64),
# 640 steps x 32 x 1024 tokens = 20.97M tokens per run, the same validation batches everywhere.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site FP4TRAIN_CACHE=/tmp/fpc PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
CMP=bench/results/compare-60m-enwiki
RECIPES=${RECIPES:-tib2d,nvfp4,fp8_rowwise,hadamard_mxfp4,adahop,mxfp4}  # longest runs first
SLOTS=${SLOTS:-1,1,0,0}  # two runs per GPU: ~20% more FP4 throughput than one
run_compare() {  # $1: recipes, $2: slots, $3: seconds
  timeout "$3" python3 -m fp4train compare --model 60m --data .data/enwiki --recipes "$1" --seeds 0,1 \
    --lr 1.2e-3 --warmup-steps 64 --max-steps 640 --seq-len 1024 --batch-size 32 \
    --eval-every 64 --eval-batches 16 --ckpt-every 0 --numerics ${NUMERICS:-triton} --gpus "$2" --out $CMP
  echo "compare exit $?"
}
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpus.txt
ok=1
if [ "${3:-}" = pytest ]; then
  run_compare bf16 1 "$(( $2 - 30 ))" > $OUT/compare_bf16.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py \
    tests/test_numerics_modes.py tests/test_fused_operands.py tests/test_backends.py > $OUT/pytest.log 2>&1 || ok=0
  tail -3 $OUT/pytest.log
  wait  # the BF16 runs (~1-2 min): two compares must not start the same run
  rm -f $CMP/report.md $CMP/report.json $CMP/loss.png  # a BF16-only report is not the comparison's
fi
LEFT=$(( $2 - ($(date +%s) - T0) ))
if [ $ok = 1 ] && [ $LEFT -gt 120 ]; then
  run_compare "$RECIPES" "$SLOTS" "$LEFT" > $OUT/compare.log 2>&1
else
  echo "FP4 runs not started (tests ok=$ok, seconds left $LEFT)" > $OUT/compare.log
fi
wait
done_runs=$(cd $CMP/runs && for d in *; do [ -f $d/summary.json ] && echo $d; done)
echo "finished: $done_runs" >> $OUT/compare.log
(cd $CMP && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude=checkpoints.json $(for d in $done_runs; do echo runs/$d; done) report.* loss.png 2>/dev/null)
for d in $CMP/runs/*; do tail -3 $d/train.log 2>/dev/null | sed "s|^|$(basename $d): |"; done >> $OUT/compare.log
cat $OUT/compare.log; tail -5 $OUT/pytest.log 2>/dev/null
