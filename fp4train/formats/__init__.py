"""Reference numerics: FP4/FP8 formats in plain PyTorch (the oracle every kernel is tested against).

Nothing here imports a kernel or keeps a mode: :func:`quantize` is the reference on any device, always.
How a converted layer runs the same bits faster (Triton kernels, compiled cores) is its
:class:`~fp4train.quantizer.Quantizer`'s business.
"""

from .layout import BlockLayout
from .qtensor import QuantizedTensor
from .quantize import FORMATS, ROUNDINGS, FormatInfo, dequantize, fake_quantize, quantize
from .scales import ScaleRule

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
]
