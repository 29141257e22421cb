"""Triton kernels with the same signatures and results as the reference numerics.

Importing this package needs Triton; the reference (``fp4train.formats``) never does. On a CPU
the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, small shapes: tests only).
"""

from .mx_fold import quantize_mxfp4_fp8
from .mx_quantize import quantize_mxfp4, quantize_mxfp4_2d, quantize_mxfp4_dual, quantize_mxfp8, quantize_mxfp8_2d
from .scaled_decode import decode_scaled_bf16
from .fp8_values import fp8_rowwise_values
from .hadamard import block_hadamard
from .mx_values import mxfp4_values, mxfp8_values
from .nvfp4_quantize import quantize_nvfp4
from .nvfp4_tiles import nvfp4_tile_values, quantize_nvfp4_2d
from .nvfp4_values import nvfp4_values

__all__ = ["block_hadamard", "decode_scaled_bf16", "fp8_rowwise_values", "mxfp4_values", "mxfp8_values", "nvfp4_tile_values", "nvfp4_values", "quantize_mxfp4", "quantize_mxfp4_2d", "quantize_mxfp4_dual", "quantize_mxfp4_fp8", "quantize_mxfp8", "quantize_mxfp8_2d", "quantize_nvfp4", "quantize_nvfp4_2d"]
