"""The quantized linear layer: one autograd Function (three GEMMs) and its nn.Module."""

from .function import QuantizedLinearFunction
from .module import QuantizedLinear

__all__ = ["QuantizedLinear", "QuantizedLinearFunction"]
