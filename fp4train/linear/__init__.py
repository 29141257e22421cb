"""The quantized linear layer: its nn.Module, the ``torch.library`` ops it runs, and the three GEMMs."""

from .module import QuantizedLinear

__all__ = ["QuantizedLinear"]
