"""fp4train: train language models in 4-bit floating point (MXFP4, NVFP4) at BF16 quality.

The pieces, in the order data flows through them:

* :func:`convert` swaps ``nn.Linear`` layers for :class:`QuantizedLinear`;
* the quantized linear (one op, three GEMMs: :mod:`fp4train.linear`) asks its **recipe**
  (:mod:`fp4train.recipes`, plain data) how to prepare each operand;
* its **quantizer** (:mod:`fp4train.quantizer`) prepares it: the plain-PyTorch reference of
  :mod:`fp4train.formats` and :mod:`fp4train.transforms`, or a Triton kernel with the same bits
  (:mod:`fp4train.kernels`), as the layer's configuration says;
* a GEMM **backend** (:mod:`fp4train.backends`) multiplies.
"""

from . import backends, formats, recipes, transforms
from .convert import convert, unconvert
from .formats import FORMATS, QuantizedTensor, dequantize, fake_quantize, quantize
from .linear import QuantizedLinear
from .quantizer import Quantizer
from .recipes import Recipe
from .transforms import hadamard

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "QuantizedLinear",
    "QuantizedTensor",
    "Quantizer",
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
    "unconvert",
]
