# Sourced by the device-call scripts: `ro MODEL RECIPES SECONDS` runs bench/train_speed.py in CUDA graphs
# (--compile-mode reduce-overhead, seq 2048, batch 8) for the recipes, BF16 first, within SECONDS, writing
# $OUT/train_speed-MODEL-reduce-overhead-$C.json and printing its tokens/s lines. Needs C (the commit) and OUT.
ro() {
  timeout $3 python3 bench/train_speed.py --model $1 --seq-len 2048 --batch-size 8 --compile --compile-mode reduce-overhead \
    --recipes $2 --warmup 3 --steps 8 --json $OUT/train_speed-$1-reduce-overhead-$C.json > $OUT/train_speed_ro-$1.log 2>&1
  echo "$1 rc $?"; grep -E "tokens/s|FAILED" $OUT/train_speed_ro-$1.log | cut -c1-300
}
