"""Full-Stack FP4's LoRA-SVD linear: a low-rank principal subspace in high precision, the rest quantized.

The weight is split ``W = W_res + beta * B A`` with ``B [N, r]`` and ``A [r, K]`` from a randomized SVD of
``W`` (Halko et al., ``torch.svd_lowrank``): ``W ~ U S V^T`` gives ``B = U S^(1/2) / beta^(1/2)`` and
``A = S^(1/2) V^T / beta^(1/2)``, and ``W_res = W - beta * B A`` holds what the subspace leaves. The
residual runs the layer's quantized GEMMs (the recipe's LinearSpec, NVFP4 in the ``fullstack`` recipe); the
factors stay in the master dtype and multiply in the compute dtype:

    Y  = Q(X) Q(W_res)^T + beta * (X A^T) B^T
    dX = Q(dY) Q(W_res)  + beta * (dY B) A

Subspace-constrained backward (our reading of the paper's section 3.2): the full weight gradient
``G = dY^T X`` is computed once, by the residual's quantized wgrad GEMM, and the factors' gradients are its
projections onto the subspace, ``dB = beta * G A^T`` and ``dA = beta * B^T G`` - the chain rule of
``W = W_res + beta * B A`` - so no GEMM over the tokens is repeated for the factors; ``W_res`` gets ``G``.

Realignment (:func:`realign`) recomputes the split from the effective weight ``W_res + beta * B A``, which
it leaves unchanged up to one FP32 rounding per element; a training run realigns every
``LoRASVDSpec.realign_every`` steps (:mod:`fp4train.linear.lora_svd_realignment`) and resets the factors'
optimizer state (their basis changed). Sharded (FSDP2), every process gathers the three tensors, computes the
same (seeded) split and keeps its own rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..recipes.spec import LinearSpec, LoRASVDSpec
from ..row_shards import assign, full, is_sharded
from .conv1d import sharing_conv1d
from .module import QuantizedLinear
from .shared_input import SharedInput


def svd_factors(w: torch.Tensor, rank: int, beta: float, *, niter: int = 2, seed: int = 0,
                oversample: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B [N, r], A [r, K])`` in FP32 with ``beta * B A`` the randomized rank-``r`` SVD approximation of ``w``.

    The range finder samples ``r + oversample`` directions (Halko, Martinsson and Tropp's oversampling: the
    subspace it finds holds the top ``r`` singular directions more fully) and the factors keep the top ``r``. It
    draws from its own generator seeded with ``seed``: the global RNG (data order, dropout) is untouched and the
    split is reproducible.
    """
    wf = w.detach().float()
    rank = min(rank, *wf.shape)
    devices = [wf.device] if wf.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(wf, q=min(rank + oversample, *wf.shape), niter=niter)
    u, s, v = u[:, :rank], s[:rank], v[:, :rank]
    root = (s / beta).sqrt()
    return u * root[None, :], root[:, None] * v.T


class _SubspaceGrad(torch.autograd.Function):
    """Forward: ``W_res`` as it is. Backward: the weight gradient ``G`` to ``W_res`` and its projections
    ``beta * B^T G`` and ``beta * G A^T`` to ``A`` and ``B``."""

    @staticmethod
    def forward(ctx, w_res, a, b, beta: float):
        ctx.save_for_backward(a, b)
        ctx.beta = beta
        return w_res.view_as(w_res)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        gf = g.float()
        da = (b.float().T @ gf).mul_(ctx.beta) if ctx.needs_input_grad[1] else None
        db = (gf @ a.float().T).mul_(ctx.beta) if ctx.needs_input_grad[2] else None
        return g, None if da is None else da.to(a.dtype), None if db is None else db.to(b.dtype), None


class _LowRankInput(torch.autograd.Function):
    """``beta * (X A^T) B^T`` whose backward gives ``X`` its gradient only (the factors get theirs from
    :class:`_SubspaceGrad`)."""

    @staticmethod
    def forward(ctx, x, a, b, beta: float, dtype: torch.dtype):
        ctx.save_for_backward(a, b)
        ctx.beta, ctx.x_dtype = beta, x.dtype
        return ((x.to(dtype) @ a.to(dtype).T) @ b.to(dtype).T) * beta

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        dx = ((dy @ b.to(dy.dtype)) @ a.to(dy.dtype)) * ctx.beta
        return dx.to(ctx.x_dtype), None, None, None, None


#: the state-dict key of a LoRA-SVD layer's residual ``W_res`` (its ``weight`` key holds ``W``, as a plain linear's)
RESIDUAL = "weight_residual"


class LoRASVDLinear(QuantizedLinear):
    """A :class:`QuantizedLinear` whose ``weight`` is the residual ``W_res`` of ``W = W_res + beta * B A``.

    ``lora_a [r, in]`` and ``lora_b [out, r]`` are parameters in the master dtype; ``weight`` keeps its
    identity (an optimizer made before the swap still holds it). :meth:`merged_weight` gives ``W``;
    :meth:`to_linear` a plain ``nn.Linear`` with it.

    Its state dict holds ``W`` under ``weight`` - what a plain ``nn.Linear`` holds, so that loading it into the
    unconverted model gives the trained weights, never the residual - and ``W_res`` under ``weight_residual``,
    from which a converted model loads its residual exactly (a state dict without that key is an earlier one,
    whose ``weight`` is the residual). A plain model refuses the extra keys with ``strict=True``. A sharded layer
    (FSDP2) keeps that earlier form, its residual under ``weight``: merging would gather the factors from every
    process, a collective that a state dict taken on one process would wait on forever (``fp4train export``
    merges a sharded run's checkpoint).
    """

    def __init__(self, *args, **kwargs):  # made with from_linear
        raise TypeError("make a LoRASVDLinear with LoRASVDLinear.from_linear(linear, spec, lora=LoRASVDSpec(...))")

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: LinearSpec, *, lora: LoRASVDSpec, seed: int = 0, backend: str = "emulated",
                    numerics: str = "eager", device_seeds: bool = False, recipe_name: str = "",
                    shared_input: SharedInput | None = None) -> LoRASVDLinear:
        """Split ``linear``'s weight in place (``weight`` becomes ``W_res``) and add the factors."""
        new = super().from_linear(linear, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                                  recipe_name=recipe_name, shared_input=shared_input)
        new._split(lora, seed)
        return new

    def _split(self, lora: LoRASVDSpec, seed: int) -> None:
        """Add the factors (in the weight's dtype and device) and split the weight into them and the residual."""
        self.lora, self.split_seed = lora, seed
        rank = min(lora.rank, self.in_features, self.out_features)
        w = self.weight
        self.lora_a = nn.Parameter(torch.zeros(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.realign(seed=seed)

    #: state dicts in the earlier form, the residual under ``weight`` (:func:`residual_state_dicts`)
    residual_form = False

    @property
    def beta(self) -> float:
        return self.lora.beta

    def merged_weight(self) -> torch.Tensor:
        """``W_res + beta * B A`` ``[out, in]`` in FP32 (no gradient)."""
        with torch.no_grad():
            return self._as_out_in(full(self.weight)).float() + self.beta * (full(self.lora_b).float() @ full(self.lora_a).float())

    @staticmethod
    def _as_out_in(stored: torch.Tensor) -> torch.Tensor:
        """The weight as ``[out, in]`` from its stored layout (a linear's own; a Conv1D's is transposed)."""
        return stored

    @torch.no_grad()
    def realign(self, *, seed: int | None = None) -> None:
        """A fresh randomized SVD of the effective weight: new ``A``, ``B`` and ``W_res``, the same ``W``."""
        w = self.merged_weight()
        b, a = svd_factors(w, self.lora_a.shape[0], self.beta, niter=self.lora.niter,
                           seed=self.split_seed if seed is None else seed, oversample=self.lora.oversample)
        b, a = b.to(self.lora_b.dtype), a.to(self.lora_a.dtype)  # as stored
        assign(self.lora_b, b)
        assign(self.lora_a, a)
        assign(self.weight, self._as_out_in(w - self.beta * (b.float() @ a.float())))  # [out, in] <-> stored: a transpose

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_sharded(self.weight) or self.residual_form:  # sharded: merging would gather the factors, a collective
            return  # a state dict must not make
        destination[prefix + RESIDUAL] = destination[prefix + "weight"]
        with torch.no_grad():
            destination[prefix + "weight"] = self._as_out_in(self.merged_weight()).to(self.weight.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if prefix + RESIDUAL in state_dict:  # else an earlier state dict: its weight is the residual
            state_dict[prefix + "weight"] = state_dict.pop(prefix + RESIDUAL)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _SubspaceGrad.apply(self._as_out_in(self.weight), self.lora_a, self.lora_b, self.beta)
        y = self._linear(x, w)
        return y + _LowRankInput.apply(x, self.lora_a, self.lora_b, self.beta, y.dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``W = W_res + beta * B A`` in the weight's dtype (the same bias)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.weight.device,
                        dtype=self.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.merged_weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_svd=(rank={self.lora_a.shape[0]}, beta={self.beta})"


class LoRASVDConv1D(LoRASVDLinear):
    """LoRA-SVD on transformers' ``Conv1D`` (GPT-2's transposed linear): ``weight`` stays ``[in, out]``, as the
    original's, and holds the residual; the factors are a linear's (``lora_b [out, r]``, ``lora_a [r, in]``)."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, spec: LinearSpec, *, lora: LoRASVDSpec, seed: int = 0, backend: str = "emulated",
                    numerics: str = "eager", device_seeds: bool = False, recipe_name: str = "",
                    shared_input: SharedInput | None = None) -> LoRASVDConv1D:
        """Split ``conv``'s weight in place (it becomes the residual, still transposed) and add the factors."""
        new = sharing_conv1d(cls, conv, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                             recipe_name=recipe_name, shared_input=shared_input)
        new._split(lora, seed)
        return new

    @staticmethod
    def _as_out_in(stored: torch.Tensor) -> torch.Tensor:
        return stored.mT

    def to_linear(self) -> nn.Module:
        """The original ``Conv1D`` class again, holding ``W = W_res + beta * B A`` (transposed, the same bias)."""
        conv = self.conv1d_class.__new__(self.conv1d_class)
        nn.Module.__init__(conv)
        conv.nf, conv.nx = self.out_features, self.in_features
        conv.weight = nn.Parameter(self.merged_weight().mT.to(self.weight.dtype).contiguous(), requires_grad=self.weight.requires_grad)
        conv.bias = self.bias
        conv.train(self.training)
        return conv

    def extra_repr(self) -> str:
        return "transposed weight (Conv1D), " + super().extra_repr()


@contextlib.contextmanager
def residual_state_dicts(model: nn.Module):
    """Within it, ``model``'s LoRA-SVD layers give state dicts in the form a sharded checkpoint holds (the residual
    under ``weight``, no merged weight): what ``torch.distributed.checkpoint`` reads into, whose key mapping
    takes every state-dict key for an attribute of the model."""
    layers = [m for m in model.modules() if isinstance(m, LoRASVDLinear)]
    for m in layers:
        m.residual_form = True
    try:
        yield
    finally:
        for m in layers:
            m.residual_form = False


def residual_form(state_dict: dict) -> dict:
    """``state_dict`` with every LoRA-SVD layer's residual under ``weight`` (its merged ``W`` dropped): the form a
    sharded model's state dict has, into which a single process's checkpoint is distributed."""
    out = dict(state_dict)
    for key in [k for k in out if k.endswith("." + RESIDUAL) or k == RESIDUAL]:
        out[key[: -len(RESIDUAL)] + "weight"] = out.pop(key)
    return out


def lora_svd_layers(model: nn.Module) -> list[tuple[str, LoRASVDLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRASVDLinear)]


def realign(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, seed: int = 0) -> int:
    """Realign every LoRA-SVD layer of ``model`` (see the module docstring); with ``optimizer``, drop the
    factors' state (moments in the old basis mean nothing in the new one). Returns the number of layers."""
    layers = lora_svd_layers(model)
    for i, (_, m) in enumerate(layers):
        m.realign(seed=seed * 1_000_003 + i)
        if optimizer is not None:
            for p in (m.lora_a, m.lora_b):
                optimizer.state.pop(p, None)
    return len(layers)
