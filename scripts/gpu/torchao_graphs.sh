#!/usr/bin/env bash
# (Session 21 ran what this does as scripts/gpu/table_and_torchao.sh and inline calls: docs/LOG.md, session 21.)
# Written in session 20 for a later device call (one GPU; not yet run): torchao's float8 rowwise training in CUDA
# graphs, BF16 in the same run, at 1b and 3b - the like-for-like peer of fp4train's +cudagraphs rows (bench/summary.py
# rates those against torchao compiled by default with no verdict until this exists). torchao travels as a wheel:
#   pip download --no-deps torchao==0.18.0 -d .whl   (here, once; .whl/ is git-ignored)
#   run(carry=[".whl"]): bash scripts/gpu/call_x2.sh COMMIT 590 'bash scripts/gpu/torchao_graphs.sh COMMIT'
set -u
C=$1-torchao  # the JSON names: train_speed-{1b,3b}-reduce-overhead-COMMIT-torchao.json
source scripts/gpu/ro.sh
python3 -c "import torchao; print('torchao', torchao.__version__)" || exit 1
ro 1b bf16,torchao_fp8_rowwise 240
ro 3b bf16,torchao_fp8_rowwise $(( $(LEFT) - 5 ))
