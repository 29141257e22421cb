#!/usr/bin/env bash
# One device call on the two-GPU machine: two command lists side by side, one per GPU, with the
# common setup (torchao/tomli_w wheels from .whl if carried, the source tree on PYTHONPATH, the commit named
# for the JSON files) and a deadline, so that each finishes inside the call.
#   bash scripts/gpu/call_x2.sh COMMIT SECONDS 'GPU 0 commands' ['GPU 1 commands']
# Without the GPU 1 list it runs on one GPU (the one-GPU machine).
# Each command list runs under `bash -c` with CUDA_VISIBLE_DEVICES set, $OUT as the results folder and
# `$(LEFT)` as the seconds left before the deadline (for `timeout $(LEFT) ...`); its output goes to
# $OUT/gpu0.log / $OUT/gpu1.log, whose last lines are printed at the end.
set -u
T0=$(date +%s)
if ls .whl/*.whl > /dev/null 2>&1; then  # torchao travels as wheels (carry [".whl"]) when a run needs it
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1 DEADLINE=$(( T0 + $2 - 10 ))
LEFT() { echo $(( DEADLINE - $(date +%s) )); }
export -f LEFT  # the command lists and the scripts they run (scripts/gpu/*.sh) see it and the variables above
run_on() {  # GPU, commands
  CUDA_VISIBLE_DEVICES=$1 timeout $(( DEADLINE - $(date +%s) )) bash -c "$2" > $OUT/gpu$1.log 2>&1
  echo "== GPU $1 exit $? after $(( $(date +%s) - T0 )) s"
}
NG=$(( $# > 3 ? 2 : 1 ))
run_on 0 "$3" &
[ $NG = 2 ] && run_on 1 "$4"
wait
for g in $(seq 0 $(( NG - 1 ))); do echo "== gpu$g.log"; grep -v -E "USDT|SyntaxWarning|Configuration class" $OUT/gpu$g.log | tail -25 | cut -c1-250; done
echo "device seconds used by this call: $(( $(date +%s) - T0 ))"
