"""A quantized layer for the ``Conv1D`` of Hugging Face's GPT-2 family: a linear layer whose weight is stored
transposed (``[in, out]``, ``y = x @ W + b``).

:class:`QuantizedConv1D` keeps that parameter as it is - the same ``state_dict`` keys and shapes, so GPT-2
checkpoints load unchanged - and runs the recipe's three quantized GEMMs on its transpose, a view whose gradient
autograd transposes back. :func:`fp4train.unconvert` gives the model its ``Conv1D`` again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..recipes.spec import LinearSpec
from .module import QuantizedLinear
from .shared_input import SharedInput


def is_conv1d(module: nn.Module) -> bool:
    """Is ``module`` transformers' ``Conv1D`` (GPT-2, GPT, ...): ``nf`` outputs, ``weight [in, nf]``?"""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers") and hasattr(module, "nf")


def in_out(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear layer, fp4train's quantized ones included, or of transformers'
    ``Conv1D`` (weight ``[in, out]``)."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def sharing_conv1d(cls: type[QuantizedLinear], conv: nn.Module, spec: LinearSpec, *, backend: str, numerics: str,
                   device_seeds: bool, recipe_name: str, shared_input: SharedInput | None):
    """A ``cls`` layer (a quantized layer keeping a Conv1D's ``[in, out]`` weight) sharing ``conv``'s parameters."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = conv.weight.shape
    new.weight, new.bias = conv.weight, conv.bias
    new.conv1d_class = type(conv)
    new._configure(spec, backend, numerics, device_seeds, recipe_name, shared_input)
    new.train(conv.training)
    return new


class QuantizedConv1D(QuantizedLinear):
    """transformers' ``Conv1D`` with quantized GEMMs: ``weight`` is ``[in_features, out_features]``, as the original's."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, spec: LinearSpec, *, backend: str = "emulated", numerics: str = "eager",
                    device_seeds: bool = False, recipe_name: str = "", shared_input: SharedInput | None = None) -> QuantizedConv1D:
        """A QuantizedConv1D that shares ``conv``'s parameters (no copy)."""
        return sharing_conv1d(cls, conv, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                              recipe_name=recipe_name, shared_input=shared_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight.mT)

    def to_conv1d(self) -> nn.Module:
        """The original ``Conv1D`` module class again, sharing this layer's parameters."""
        conv = self.conv1d_class.__new__(self.conv1d_class)
        nn.Module.__init__(conv)
        conv.nf, conv.nx = self.out_features, self.in_features
        conv.weight, conv.bias = self.weight, self.bias
        conv.train(self.training)
        return conv

    def extra_repr(self) -> str:
        return "transposed weight (Conv1D), " + super().extra_repr()
