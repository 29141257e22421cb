#!/usr/bin/env bash
# The 60m enwiki recipe comparison of issues #3/#4 on an H200 device machine (one GPU or more),
# in chunks of at most one device call each.
#
#   bash scripts/gpu/compare_60m.sh COMMIT SECONDS [pytest]
#
# The comparison lives in /tmp/cmp on the device, seeded from the finished runs committed in
# $CMP: `fp4train compare` skips finished runs (summary.json) and resumes interrupted ones from
# their newest checkpoint (every 64 steps), so a call that stops mid-run loses at most 64 steps of
# each run - as long as the next call comes while the machine is still warm (/tmp survives;
# after a cold start the unfinished runs start over). Finished runs come back as $OUT/runs.tgz
# (metrics, summaries, calibration tables; no checkpoints) to be unpacked into $CMP; the call
# that finishes the last run also returns report.md/json and loss.png.
#
# With `pytest`, the GPU tests of the numerics the remaining runs use (TESTS_K, a pytest -k
# expression) run first, alone (at most 240 s); the training starts only if they pass.
# Settings: BF16's learning rate from bench/results/lr_sweep-60m-enwiki (1.2e-3, warmup 64),
# 640 steps x 32 x 1024 tokens = 20.97M tokens per run, the same validation batches everywhere.
set -u
T0=$(date +%s)
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site FP4TRAIN_CACHE=/tmp/fpc PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
CMP=bench/results/compare-60m-enwiki
WORK=/tmp/cmp
RECIPES=${RECIPES:-bf16,adahop,mxfp4,hadamard_mxfp4,tib2d,nvfp4,fp8_rowwise}  # run recipe by recipe, both seeds
NGPU=$(nvidia-smi -L | wc -l)
SLOTS=${SLOTS:-$(python3 -c "print(','.join(str(g) for g in range($NGPU) for _ in range(3)))")}  # three runs per GPU
mkdir -p $WORK/runs
for d in $CMP/runs/*/; do [ -e "$WORK/runs/$(basename "$d")" ] || cp -r "$d" $WORK/runs/; done
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpus.txt
(ls $WORK/runs; grep -h '"step"' $WORK/runs/*/checkpoints.json 2>/dev/null | tail -20) > $OUT/state_before.txt

ok=1
if [ "${3:-}" = pytest ]; then  # alone: beside three training runs they did not finish in 300 s
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py tests/test_numerics_modes.py \
    -k "${TESTS_K:-nvfp4 or fp8_rowwise or hadamard or decode or e4m3 or cpu}" -rf > $OUT/pytest.log 2>&1
  # only failures in what the runs use stop them (the FP8-blockwise fold/GEMM is #5's, not theirs)
  grep -E "^(FAILED|ERROR)" $OUT/pytest.log | grep -viE "fold|blockwise" && ok=0
  grep -q -E "passed|failed" $OUT/pytest.log || ok=0  # pytest did not get to the end
  tail -3 $OUT/pytest.log
  [ $ok = 1 ] || { echo "GPU tests failed or did not finish: no training"; exit 1; }
fi
timeout -s INT $(( $2 - 25 - $(date +%s) + T0 )) python3 -m fp4train compare --model 60m --data .data/enwiki --recipes "$RECIPES" --seeds 0,1 \
  --lr 1.2e-3 --warmup-steps 64 --max-steps 640 --seq-len 1024 --batch-size 32 \
  --eval-every 64 --eval-batches 16 --ckpt-every 64 --numerics ${NUMERICS:-triton} --backend emulated --gpus "$SLOTS" --out $WORK \
  > $OUT/compare.log 2>&1
echo "compare exit $?" >> $OUT/compare.log
sleep 2
done_runs=$(cd $WORK/runs && for d in *; do [ -f $d/summary.json ] && echo $d; done)
echo "finished: $done_runs" >> $OUT/compare.log
(cd $WORK && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='*.pt.tmp' --exclude=checkpoints.json \
  $(for d in $done_runs; do echo runs/$d; done) report.* loss.png 2>/dev/null)
for d in $WORK/runs/*; do tail -2 $d/train.log 2>/dev/null | sed "s|^|$(basename $d): |"; done >> $OUT/compare.log
grep -h '"step"' $WORK/runs/*/checkpoints.json 2>/dev/null > $OUT/state_after.txt
echo "device seconds used by this call: $(( $(date +%s) - T0 ))"
cat $OUT/compare.log | grep -v "^\s*$" | tail -40
