#!/usr/bin/env bash
# The GPU tests in small groups, each under its own time limit and stopping at its first failure
# (MAXFAIL), so that a call cut short still has every finished group's result and the traceback of the
# first failure of each group (one pytest run over everything printed its tracebacks only at the
# end, and three runs in session 12 were cut before that). Most recently changed code first.
# Writes $OUT/gpu_tests.log (gpu_tests-gpuN.log under CUDA_VISIBLE_DEVICES=N); prints one line per group.
#   [ONLY="fold fold-dim0 graph-op"] [MAXFAIL=n] bash scripts/gpu/gpu_tests.sh [SECONDS_PER_GROUP]
# ONLY: the groups to run (default all); MAXFAIL: failures a group may have before it stops (default 1;
# more lets a group with a known failure still report on the rest).
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
S=${1:-90}
ONLY=${ONLY:-}
MAXFAIL=${MAXFAIL:-1}
RESULT=$OUT/gpu_tests${CUDA_VISIBLE_DEVICES:+-gpu$CUDA_VISIBLE_DEVICES}.log  # one per GPU when both run tests
group() {  # name, pytest arguments
  local name=$1; shift
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && return 0
  local log=/tmp/gpu_tests_group.$$.log
  timeout $S python3 -m pytest --maxfail=$MAXFAIL -q --tb=short -p no:cacheprovider "$@" > $log 2>&1
  local rc=$?
  { echo "=== $name"; cat $log; } >> $RESULT
  # this group's own summary line (none when it was cut)
  echo "$name: $([ $rc = 0 ] && echo passed || ([ $rc = 124 ] && echo "cut at ${S}s" || echo "FAILED (rc $rc)")); $(grep -E ' (passed|failed)' $log | tail -1 | cut -c1-120)"
}
group decode tests/test_kernels.py -k "decode_kernel"
group fold tests/test_kernels.py -k "(fold or ties_signs or launch_tuning) and not along_dim_0"  # 50 tests: 170 s on the H200 ran all but a few
group fold-dim0 tests/test_kernels.py -k "fold and along_dim_0"
group tiles-columns tests/test_kernels.py -k "2d_tile or packed or column_kernels or nvfp4_16x16"
group graph-op tests/test_graph_op.py -k "gpu or share"
group fp8-blockwise tests/test_fp8_blockwise.py
group kernels-rest tests/test_kernels.py -k "not (decode_kernel or fold or ties_signs or launch_tuning or 2d_tile or packed or column_kernels or nvfp4_16x16)"
group cuda tests/test_cuda.py
group backends tests/test_backends.py tests/test_numerics_modes.py  # the triton-vs-emulated loss curves
