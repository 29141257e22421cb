#!/usr/bin/env bash
# (Session 21 ran what this does as scripts/gpu/table_and_torchao.sh and inline calls: docs/LOG.md, session 21.)
# Written in session 20 for the next device call (one GPU; not yet run): Nsight Compute on the fused fold and the
# MXFP4 row kernel (scripts/probes/ncu_cases.py), to say why they run at 3-12x their memory floor. ncu reads the
# hardware counters only on a Firecracker machine (/work/.library/device/KINDS.md); on gVisor it fails at once, and
# the call then goes on to bench/fold_calls.py without --hadamard-only (the plain folds' launches on the step's calls).
#   bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/ncu_fold.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
uname -r; which ncu
timeout 240 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --csv --page details \
  python3 scripts/probes/ncu_cases.py > $OUT/ncu_cases-$C.csv 2> $OUT/ncu_cases-$C.err
echo "ncu rc $?"; tail -3 $OUT/ncu_cases-$C.err; grep -c "" $OUT/ncu_cases-$C.csv
timeout $(( $(LEFT) - 5 )) python3 bench/fold_calls.py --model 1b --recipe adahop \
  --json $OUT/fold_calls-1b-adahop-all-NVIDIA_H200-$C.json > $OUT/fold_calls.log 2>&1
echo "fold_calls rc $?"; grep -v -E "USDT|Warning" $OUT/fold_calls.log | tail -30 | cut -c1-220
