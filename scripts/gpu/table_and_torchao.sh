#!/usr/bin/env bash
# Session 21, first device call (one GPU): FOLD_LAUNCH_HADAMARD keyed by reads (block dim strided or not) end to end in
# CUDA graphs with torchao's float8 rowwise training in the same run (the like-for-like peer of the +cudagraphs rows),
# BF16 measured in each run: 1b with all three, then 3b with bf16 and adahop in the time left (3b's torchao: the next call).
#   run(carry=[".whl"]): bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/table_and_torchao.sh COMMIT'
set -u
C=$1  # LEFT, DEADLINE, PYTHONPATH and FP4TRAIN_COMMIT come from call_x2.sh
source scripts/gpu/ro.sh
python3 -c "import torchao; print('torchao', torchao.__version__)" || exit 1
ro 1b bf16,adahop,torchao_fp8_rowwise 300
ro 3b bf16,adahop $(( $(LEFT) - 5 ))
