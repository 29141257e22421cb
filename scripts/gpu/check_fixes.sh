#!/usr/bin/env bash
# A short check on one H200 after GPU-found fixes: the tests that failed there (tracebacks kept),
# the fold-kernel tests, then the quantize benchmark (JSON + log in $OUT).
#   bash scripts/gpu/check_fixes.sh COMMIT
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4TRAIN_COMMIT=$1
timeout 90 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_cuda.py::test_gpu_autocast_bf16 \
  tests/test_cuda.py::test_gpu_training_resumes_from_a_checkpoint tests/test_cuda.py::test_gpu_layer_matches_cpu_layer \
  tests/test_fp8_blockwise.py::test_fp8_blockwise_layer_matches_emulated > $OUT/pytest_failed_before.log 2>&1
python3 -c "
import torch, fp4train
from fp4train.backends import fp8_blockwise as f
l = fp4train.QuantizedLinear.from_linear(torch.nn.Linear(256, 256).cuda(), fp4train.recipes.get('mxfp4').linear, backend='triton')
l(torch.randn(128, 256, device='cuda')).sum().backward()
print('blockwise scaled_mm FP32 output on this torch:', f._FP32_OUT, torch.__version__)" >> $OUT/pytest_failed_before.log 2>&1
timeout 55 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernels.py -k fold > $OUT/pytest_fold.log 2>&1
timeout 50 python3 bench/quantize_speed.py --json $OUT/quantize_speed.json > $OUT/quantize_speed.log 2>&1
grep -E "passed|failed|Error|^E " $OUT/pytest_failed_before.log | cut -c1-220 | head -40; tail -1 $OUT/pytest_fold.log
grep -E "copy|fp8" $OUT/quantize_speed.log
