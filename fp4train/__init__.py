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

__version__ = "0.1.0"

#: what ``import fp4train`` offers, and the module each comes from: loaded on first use, so that the command line's
#: ``--version`` and ``--help`` answer without loading PyTorch
_EXPORTS = {
    "FORMATS": "formats", "QuantizedTensor": "formats", "dequantize": "formats", "fake_quantize": "formats",
    "quantize": "formats", "convert": "conversion", "unconvert": "conversion", "QuantizedLinear": "linear",
    "Quantizer": "quantizer", "Recipe": "recipes", "hadamard": "transforms", "calibrate": "adahop.calibration",
}
_MODULES = ("backends", "formats", "recipes", "transforms")

__all__ = ["FORMATS", "QuantizedLinear", "QuantizedTensor", "Quantizer", "Recipe", "backends", "calibrate", "convert", "dequantize",
           "fake_quantize", "formats", "hadamard", "quantize", "recipes", "transforms", "unconvert"]


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'fp4train' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
