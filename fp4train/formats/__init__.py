"""Reference numerics: FP4/FP8 formats in plain PyTorch (the oracle every kernel is tested against)."""

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
