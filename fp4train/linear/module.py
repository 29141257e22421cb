"""``QuantizedLinear``: an ``nn.Linear`` whose three GEMMs follow a :class:`LinearSpec`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import backends
from ..device_seeds import device_seed_stream
from ..quantizer import Quantizer, kernels_usable_on
from ..recipes.spec import LinearSpec
from .op import LayerConfig, call_settings, config_key, prep_fits, prep_key
from .plan import OperandPlan, plan_for
from .shared_input import SharedInput


class QuantizedLinear(nn.Linear):
    """Drop-in ``nn.Linear`` with quantized GEMMs.

    It *is* an ``nn.Linear`` (same ``weight``/``bias`` parameters and ``state_dict`` keys), so
    optimizers, checkpoints and FSDP-style wrappers keep working after :func:`fp4train.convert`.
    Weights stay in their master dtype; quantization happens on the fly in every call.

    Everything that decides its numerics is configuration of this layer, set when it is made:

    * ``spec``: what each GEMM operand becomes (from the recipe; AdaHOP's calibration sets it later);
    * ``backend``: which GEMMs multiply (``emulated``, ``fp8_blockwise``: :mod:`fp4train.backends`);
    * ``numerics``: how operands are quantized - the reference, compiled cores or Triton kernels, the same
      bits (:class:`~fp4train.quantizer.Quantizer`);
    * ``device_seeds``: draw stochastic-rounding seeds on the device (:mod:`fp4train.device_seeds`), which
      ``torch.compile(mode="reduce-overhead")`` captures in CUDA graphs with fresh draws on every replay;
      host seeds (torch's CPU generator) otherwise. The same distribution, other bits.

    From these the layer's operand plan (:mod:`fp4train.linear.plan`, :meth:`plan`) says which implementation
    prepares each of its six GEMM operands and which GEMM multiplies them; ``print(layer)`` shows it.
    One implementation runs eagerly and compiled: the ``torch.library`` ops of :mod:`fp4train.linear.op`.
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
        numerics: str = "eager",
        device_seeds: bool = False,
        recipe_name: str = "",
        shared_input: SharedInput | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(spec, backend, numerics, device_seeds, recipe_name, shared_input)

    def _configure(self, spec: LinearSpec, backend: str, numerics: str, device_seeds: bool, recipe_name: str,
                   shared_input: SharedInput | None) -> None:
        self.backend_name = backends.resolve(backend)  # "auto" and former names resolved
        self.backend = backends.get(self.backend_name)
        self.quantizer = Quantizer(numerics)
        self.device_seeds = bool(device_seeds)
        self.recipe_name = recipe_name
        #: the memo that layers reading the same input share eagerly (one per converted model)
        self.shared_input = shared_input if shared_input is not None else SharedInput()
        self.spec = spec
        self._allocate_backend_state()

    @property
    def numerics(self) -> str:
        return self.quantizer.numerics

    def _allocate_backend_state(self) -> None:
        """Let the backend's operand preparation allocate the state it keeps per device (fp8_blockwise/triton: the
        inexact counter) on the weight's device now, outside any compiled call (see ``Fp8Operands.allocate_state``)."""
        # whatever the spec: AdaHOP's layers start unquantized and get their specs from calibration
        allocate = getattr(getattr(getattr(self, "backend", None), "operands", None), "allocate_state", None)
        weight = getattr(self, "weight", None)
        if weight is None or weight.device.type == "meta":
            return
        if allocate is not None:
            allocate(weight.device)
        # the seed stream too: made inside a captured call it would sit in the graph's pool
        if getattr(self, "device_seeds", False):
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
        self._spec = spec
        cfg = LayerConfig(spec, self.backend_name, self.quantizer.numerics, self.device_seeds)
        self._layer_config = cfg
        self._config = config_key(cfg)  # what the ops take for this layer
        self._prep = prep_key(cfg)  # its shared X preparation, if the specs allow one

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: LinearSpec, *, backend: str = "emulated", numerics: str = "eager",
                    device_seeds: bool = False, recipe_name: str = "",
                    shared_input: SharedInput | None = None) -> QuantizedLinear:
        """A QuantizedLinear that shares ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._configure(spec, backend, numerics, device_seeds, recipe_name, shared_input)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` through this layer's quantized GEMMs (``weight``: this layer's, or a tensor made
        from it that carries its gradient elsewhere, as the LoRA-SVD layer's does)."""
        if not self.spec.quantized:
            return F.linear(x, weight, self.bias)
        out_dtype, save_x, save_w = call_settings(x, weight)
        x_prep = []
        if save_x and self._prep is not None and prep_fits(x, self._layer_config):
            prep = self._prep

            def make():
                return torch.ops.fp4train.prepare_x(x, prep, out_dtype)

            # in a graph the compiler merges equal calls; eagerly the model's memo shares them
            x_prep = make() if torch.compiler.is_compiling() else self.shared_input.get(x, (prep, out_dtype), make)
        return torch.ops.fp4train.quantized_linear(x, weight, self.bias, self._config, out_dtype, save_x, save_w, x_prep)[0]

    #: True while a calibrating recipe (AdaHOP) has not yet given this layer its strategies: it runs in BF16
    uncalibrated: bool = False

    def plan(self, tokens: int = 2048, dtype: torch.dtype | None = None) -> OperandPlan | None:
        """The operand plan of a training call on ``tokens`` rows of X (``dtype``: X's and the compute dtype; default:
        BF16 on a GPU, the weight's dtype elsewhere) on the weight's device; None where nothing is quantized."""
        if not self.spec.quantized:
            return None
        w = self.weight
        if dtype is None:
            dtype = torch.bfloat16 if w.is_cuda else w.dtype
        x = torch.empty(tokens, self.in_features, dtype=dtype, device=w.device) if w.device.type != "meta" else None
        cuda = w.is_cuda
        usable = kernels_usable_on(x) if x is not None else False
        shared = x is not None and self._prep is not None and prep_fits(x, self._layer_config)
        return plan_for(self._config, tokens, self.in_features, self.out_features, dtype, w.dtype, dtype, cuda, usable,
                        x_shared=shared)

    def extra_repr(self) -> str:
        r = f", recipe={self.recipe_name}" if self.recipe_name else ""
        r += " (uncalibrated: runs in BF16)" if self.uncalibrated else ""
        r = super().extra_repr() + r + f", backend={self.backend_name}, numerics={self.numerics}"
        plan = self.plan()
        if plan is not None:
            r += "\n" + plan.describe()
        return r
