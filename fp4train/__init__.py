"""fp4train: train language models in 4-bit floating point (MXFP4, NVFP4) at BF16 quality.

The pieces, in the order data flows through them:

* :func:`convert` swaps ``nn.Linear`` layers for :class:`QuantizedLinear`;
* the quantized linear (one autograd Function, three GEMMs) asks its **recipe**
  (:mod:`fp4train.recipes`, plain data) how to prepare each operand;
* **formats** (:mod:`fp4train.formats`, plain-PyTorch reference numerics) and
  **transforms** (:mod:`fp4train.transforms`) prepare it;
* a GEMM **backend** (:mod:`fp4train.backends`) multiplies.
"""

from . import backends, formats, recipes, transforms
from .convert import convert
from .formats import FORMATS, QuantizedTensor, dequantize, fake_quantize, quantize
from .linear import QuantizedLinear, QuantizedLinearFunction
from .recipes import Recipe
from .transforms import hadamard

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "QuantizedLinear",
    "QuantizedLinearFunction",
    "QuantizedTensor",
    "Recipe",
    "backends",
    "convert",
    "dequantize",
    "fake_quantize",
    "formats",
    "hadamard",
    "quantize",
    "recipes",
    "transforms",
]
