#!/usr/bin/env bash
# Session 18, second call (one GPU): tib2d's dY folded for both GEMMs in one pass and MXFP8 along dim 0 without a
# copy - their GPU tests, their kernel speed beside what they replace (bench/quantize_speed.py), then end to end in
# CUDA graphs: 1b bf16/tib2d and 3b bf16/tib2d/adahop.
#   bash scripts/gpu/call_x2.sh COMMIT 560 'bash scripts/gpu/tiles_pair.sh COMMIT'
set -u
C=$1
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$C
timeout 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_fp8_blockwise.py \
  tests/test_kernels.py -k "column_kernels or tiles_fold_pair or seed_from_the_device or tib2d or one_pass or tile_fold" > $OUT/pytest_pair.log 2>&1
echo "tests rc $?: $(tail -1 $OUT/pytest_pair.log)"; grep -E "^E |FAILED" $OUT/pytest_pair.log | cut -c1-200 | head -10
timeout 100 python3 bench/quantize_speed.py --json $OUT/quantize_speed-NVIDIA_H200-$C.json > $OUT/quantize_speed.log 2>&1
echo "quantize rc $?"; grep -E "copy|32x32|dim 0|both folds|two folds" $OUT/quantize_speed.log
ro() {  # model recipes seconds
  timeout $3 python3 bench/train_speed.py --model $1 --seq-len 2048 --batch-size 8 --compile --compile-mode reduce-overhead \
    --recipes $2 --warmup 3 --steps 8 --json $OUT/train_speed-$1-reduce-overhead-$C.json > $OUT/train_speed_ro-$1.log 2>&1
  echo "$1 rc $?"; grep -E "tokens/s|FAILED" $OUT/train_speed_ro-$1.log | cut -c1-300
}
ro 1b bf16,tib2d 170
ro 3b bf16,tib2d,adahop $(( $(LEFT) - 5 ))
