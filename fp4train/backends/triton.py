"""The ``triton`` backend: fp4train's fast path on Hopper, the default on CUDA.

What it adds up to (every piece bit-identical to the reference numerics, except FP32 rounding
inside the GEMMs):

* operands are quantized by fp4train's Triton kernels: :func:`fp4train.convert` gives its layers
  ``"triton"`` numerics on a machine with a GPU unless asked for others;
* MXFP4 GEMMs (1x32 blocks, inner dimension a multiple of 128) run on FP8 tensor cores with
  1x128 / 128x128 group scales, as the ``fp8_blockwise`` backend does;
* everything else (NVFP4, FP8 rowwise, MXFP8, 32x32 tiles, odd shapes) runs on BF16 tensor cores
  through the emulated GEMM's exact BF16 split.

On a CPU it is the ``emulated`` backend (every operand goes the reference way).
"""

from __future__ import annotations

from .fp8_blockwise import Fp8BlockwiseBackend


class TritonBackend(Fp8BlockwiseBackend):
    """The ``fp8_blockwise`` GEMMs plus Triton-kernel quantization (see the module docstring)."""

    name = "triton"
    splits_with_kernel = True
    numerics = "triton"  # the numerics convert() gives this backend's layers on a GPU by default
