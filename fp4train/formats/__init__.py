"""Reference numerics: FP4/FP8 formats in plain PyTorch (the oracle every kernel is tested against)."""

import torch

from .layout import BlockLayout
from .qtensor import QuantizedTensor
from .quantize import FORMATS, ROUNDINGS, FormatInfo, dequantize, fake_quantize, quantize
from .scales import ScaleRule


def set_compiled(enabled: bool = True) -> None:
    """Run quantize/dequantize (and Hadamard) numerics through ``torch.compile``: fused, same bits."""
    from ..transforms.hadamard import set_compiled as _transform_compiled
    from .qtensor import set_compiled as _decode_compiled
    from .quantize import set_compiled as _encode_compiled

    _encode_compiled(enabled)
    _decode_compiled(enabled)
    _transform_compiled(enabled)


NUMERICS = ("eager", "compiled", "triton")
_MODE = "eager"
_CHOSEN = False  # did anyone call set_numerics()? (then prefer_numerics() leaves the mode alone)


def numerics() -> str:
    """The mode :func:`set_numerics` (or :func:`prefer_numerics`) set last."""
    return _MODE


def prefer_numerics(mode: str) -> None:
    """Switch to ``mode`` unless a mode was chosen with :func:`set_numerics` - what a backend
    that has a faster way to the same bits asks for (``convert(..., backend="triton")``)."""
    if not _CHOSEN and _MODE != mode:
        _apply_numerics(mode)


def set_numerics(mode: str) -> None:
    """How quantization runs - always with the same results bit for bit:

    * ``"eager"``: the plain-PyTorch reference, op by op (the default);
    * ``"compiled"``: the reference's numerical cores (quantize, dequantize, Hadamard) through
      ``torch.compile`` (fused); the quantized linear prepares each operand that a GEMM uses
      at once in one compiled graph (:func:`fp4train.linear.operands.prepare_now`); on a GPU
      the block Hadamard transform of 2D tensors runs as a Triton kernel;
    * ``"triton"``: fp4train's Triton kernels where one exists for the request (MXFP4 and MXFP8
      1x32 and 32x32, NVFP4 1x16, along either axis of a 2D tensor with whole blocks; the block
      Hadamard transform of 2D GPU tensors; fake quantization straight to BF16 for the quantized
      linear; docs/formats.md lists them), elsewhere the compiled path on a GPU and the reference
      on a CPU (where Triton runs interpreted, for tests).

    A mode set here is kept: backends that prefer another (:func:`prefer_numerics`) leave it.
    """
    global _CHOSEN
    _apply_numerics(mode)
    _CHOSEN = True


def reset_numerics() -> None:
    """Back to the default: ``"eager"`` numerics, no mode chosen (a backend's preference applies again)."""
    global _CHOSEN
    _apply_numerics("eager")
    _CHOSEN = False


def _apply_numerics(mode: str) -> None:
    from ..transforms.hadamard import set_kernel as set_transform_kernel
    from .qtensor import set_split_kernel
    from .quantize import set_kernels  # the module, not the quantize() function of the same name

    global _MODE
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics {mode!r}; choose one of {NUMERICS}")
    _MODE = mode
    cuda = torch.cuda.is_available()
    # triton on a GPU: the compiled path wherever no kernel covers a request
    set_compiled(mode == "compiled" or (mode == "triton" and cuda))
    set_kernels(mode == "triton")
    set_transform_kernel(mode != "eager" and cuda)
    if mode == "triton":
        from ..kernels.scaled_decode import decode_scaled_bf16

        set_split_kernel(decode_scaled_bf16)  # MXFP4/NVFP4/MXFP8 codes (the saved X, MXFP8 operands) -> BF16 values, one pass
    else:
        set_split_kernel(None)


__all__ = [
    "BlockLayout",
    "FORMATS",
    "FormatInfo",
    "QuantizedTensor",
    "ROUNDINGS",
    "ScaleRule",
    "dequantize",
    "fake_quantize",
    "quantize",
    "NUMERICS",
    "numerics",
    "reset_numerics",
    "set_compiled",
    "set_numerics",
]
