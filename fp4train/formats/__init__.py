"""Reference numerics: FP4/FP8 formats in plain PyTorch (the oracle every kernel is tested against)."""

from .layout import BlockLayout
from .qtensor import QuantizedTensor
from .quantize import FORMATS, ROUNDINGS, FormatInfo, dequantize, fake_quantize, quantize
from .scales import ScaleRule


def set_compiled(enabled: bool = True) -> None:
    """Run quantize/dequantize numerics through ``torch.compile``: fused kernels, same bits."""
    from .qtensor import set_compiled as _decode_compiled
    from .quantize import set_compiled as _encode_compiled

    _encode_compiled(enabled)
    _decode_compiled(enabled)

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
    "set_compiled",
]
