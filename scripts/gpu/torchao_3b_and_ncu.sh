#!/usr/bin/env bash
# Session 21, second device call (one GPU): torchao's float8 rowwise training at 3b in CUDA graphs (BF16 in the same
# run), then Nsight Compute on the fused fold and the MXFP4 row kernel (scripts/probes/ncu_cases.py) in the time left.
#   run(carry=[".whl"]): bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/torchao_3b_and_ncu.sh COMMIT'
set -u
C=$1-torchao  # train_speed-3b-reduce-overhead-COMMIT-torchao.json
source scripts/gpu/ro.sh
python3 -c "import torchao; print('torchao', torchao.__version__)" || exit 1
ro 3b bf16,torchao_fp8_rowwise 290
C=$1
uname -r; which ncu
timeout $(( $(LEFT) - 5 )) ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --csv --page details \
  python3 scripts/probes/ncu_cases.py > $OUT/ncu_cases-$C.csv 2> $OUT/ncu_cases-$C.err
echo "ncu rc $?"; tail -3 $OUT/ncu_cases-$C.err; grep -c "" $OUT/ncu_cases-$C.csv
