"""``QuantizedLinear``: an ``nn.Linear`` whose three GEMMs follow a :class:`LinearSpec`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import backends
from ..counter_rng import device_seed_stream, fresh_seed
from ..recipes.spec import LinearSpec
from .function import QuantizedLinearFunction, fprop


class QuantizedLinear(nn.Linear):
    """Drop-in ``nn.Linear`` with quantized GEMMs.

    It *is* an ``nn.Linear`` (same ``weight``/``bias`` parameters and ``state_dict`` keys), so
    optimizers, checkpoints and FSDP-style wrappers keep working after :func:`fp4train.convert`.
    Weights stay in their master dtype; quantization happens on the fly in every call.

    A spec that quantizes nothing runs ``F.linear`` itself, bit-identical to ``nn.Linear``.
    Under autocast the output dtype is the autocast dtype (BF16 on GPU); unquantized operands
    are cast to it, quantized ones are quantized from the master values directly.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        spec: LinearSpec,
        backend: str = "emulated",
        recipe_name: str = "",
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(spec, backend, recipe_name)

    def _configure(self, spec: LinearSpec, backend: str, recipe_name: str) -> None:
        _make_uncompiled()
        self.backend_name = backend
        self.backend = backends.get(backend)
        self.spec = spec
        self.recipe_name = recipe_name
        self._allocate_backend_state()

    def _allocate_backend_state(self) -> None:
        """Let the backend allocate the state it keeps per device (fp8_blockwise/triton: the inexact counter)
        on the weight's device now, outside any compiled call (see ``Fp8BlockwiseBackend.allocate_state``)."""
        # whatever the spec: AdaHOP's layers start unquantized and get their specs from calibration
        allocate = getattr(getattr(self, "backend", None), "allocate_state", None)
        weight = getattr(self, "weight", None)
        if weight is None or weight.device.type == "meta":
            return
        if allocate is not None:
            allocate(weight.device)
        if DEVICE_SEEDS:  # the seed stream too: made inside a captured call it would sit in the graph's pool
            device_seed_stream(weight.device)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ...: the module moves, and the backend's state follows to its new device."""
        out = super()._apply(fn, *args, **kwargs)
        self._allocate_backend_state()
        return out

    @property
    def spec(self) -> LinearSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: LinearSpec) -> None:
        from .graph_op import config_key, prep_key, with_device_seeds

        self._spec = spec
        self._config = config_key(spec, self.backend_name)  # what the graph op takes for (spec, backend)
        self._config_device_seeds = with_device_seeds(self._config)  # the same, its seeds drawn on the device
        self._prep = prep_key(spec, self.backend_name)  # its shared X preparation, if the specs allow one

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: LinearSpec, *, backend: str = "emulated", recipe_name: str = "") -> QuantizedLinear:
        """A QuantizedLinear that shares ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._configure(spec, backend, recipe_name)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.quantized:
            return F.linear(x, self.weight, self.bias)
        if IN_GRAPH and torch.compiler.is_compiling():
            from .graph_op import quantized_linear_in_graph

            # DEVICE_SEEDS: a global that dynamo guards on (flipping it recompiles); the op's config carries it
            config = self._config_device_seeds if DEVICE_SEEDS else self._config
            return quantized_linear_in_graph(x, self.weight, self.bias, config, self._prep, self._out_dtype(x))
        return _UNCOMPILED(self, x)

    @staticmethod
    def _out_dtype(x: torch.Tensor) -> torch.dtype:
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self._out_dtype(x)
        seed = fresh_seed() if self.spec.needs_seed else 0
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return QuantizedLinearFunction.apply(x, self.weight, self.bias, self.spec, self.backend, seed, out_dtype)
        # no gradient will be asked for: GEMM 1 alone, nothing prepared or saved for backward
        with torch.autocast(x.device.type, enabled=False):
            y, *_ = fprop(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self.spec, self.backend, seed, out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    #: True while a calibrating recipe (AdaHOP) has not yet given this layer its strategies: it runs in BF16
    uncalibrated: bool = False

    def extra_repr(self) -> str:
        r = f", recipe={self.recipe_name}" if self.recipe_name else ""
        r += " (uncalibrated: runs in BF16)" if self.uncalibrated else ""
        return super().extra_repr() + r + f", backend={self.backend_name}"


# Under torch.compile a quantized linear is one op of the model's graph (graph_op.py): its numerics are
# fp4train's kernels or reference ops as they are (the same bits), not a re-compilation of them, and the
# rest of the model compiles around it in one graph. IN_GRAPH = False (set_in_graph) restores the older
# way: the model's graph breaks at every quantized linear, which runs uncompiled (compare the two with
# bench/train_speed.py --graph-breaks). The disabled wrapper is made when the first layer is, not at
# import (torch.compiler.disable imports dynamo: ~1 s).
IN_GRAPH = True
_UNCOMPILED = None


#: Compiled layers draw their stochastic-rounding seeds on the device (set_device_seeds).
DEVICE_SEEDS = False


def set_device_seeds(enabled: bool = True) -> None:
    """Let quantized layers under ``torch.compile`` draw their stochastic-rounding seeds on the device
    (:class:`~fp4train.counter_rng.DeviceSeedStream`) instead of from torch's CPU generator, so that
    ``torch.compile(mode="reduce-overhead")`` can capture seeded layers (tib2d's, hadamard_mxfp4's) in CUDA
    graphs and each replay still draws fresh seeds. The draws have the same distribution as host seeds but
    other bits, and eager calls keep host seeds. Random Hadamard signs (NVFP4's RHT) come from the device seed
    too. Set it before the model is converted or moved to its device:
    the streams are made then, outside any capture. A checkpoint saves the streams' state
    (:func:`~fp4train.counter_rng.device_seed_state`)."""
    global DEVICE_SEEDS
    DEVICE_SEEDS = bool(enabled)


def set_in_graph(enabled: bool = True) -> None:
    """Keep quantized linears in a compiled model's graph (True, the default) or break the graph at each.
    Takes effect for models compiled afterwards (``torch._dynamo.reset()`` drops earlier compilations)."""
    global IN_GRAPH
    IN_GRAPH = bool(enabled)


def _make_uncompiled() -> None:
    global _UNCOMPILED
    if _UNCOMPILED is None:
        _UNCOMPILED = torch.compiler.disable(QuantizedLinear._quantized)
