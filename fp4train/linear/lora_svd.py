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

import torch
import torch.nn as nn

from ..recipes.spec import LinearSpec, LoRASVDSpec
from ..row_shards import assign, full
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


class LoRASVDLinear(QuantizedLinear):
    """A :class:`QuantizedLinear` whose ``weight`` is the residual ``W_res`` of ``W = W_res + beta * B A``.

    ``lora_a [r, in]`` and ``lora_b [out, r]`` are parameters in the master dtype; ``weight`` keeps its
    identity (an optimizer made before the swap still holds it). :meth:`merged_weight` gives ``W``;
    :meth:`to_linear` a plain ``nn.Linear`` with it.
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
        new.lora = lora
        new.split_seed = seed
        rank = min(lora.rank, new.in_features, new.out_features)
        w = new.weight
        new.lora_a = nn.Parameter(torch.zeros(rank, new.in_features, device=w.device, dtype=w.dtype))
        new.lora_b = nn.Parameter(torch.zeros(new.out_features, rank, device=w.device, dtype=w.dtype))
        new.realign(seed=seed)
        return new

    @property
    def beta(self) -> float:
        return self.lora.beta

    def merged_weight(self) -> torch.Tensor:
        """``W_res + beta * B A`` in FP32 (no gradient)."""
        with torch.no_grad():
            return full(self.weight).float() + self.beta * (full(self.lora_b).float() @ full(self.lora_a).float())

    @torch.no_grad()
    def realign(self, *, seed: int | None = None) -> None:
        """A fresh randomized SVD of the effective weight: new ``A``, ``B`` and ``W_res``, the same ``W``."""
        w = self.merged_weight()
        b, a = svd_factors(w, self.lora_a.shape[0], self.beta, niter=self.lora.niter,
                           seed=self.split_seed if seed is None else seed, oversample=self.lora.oversample)
        b, a = b.to(self.lora_b.dtype), a.to(self.lora_a.dtype)  # as stored
        assign(self.lora_b, b)
        assign(self.lora_a, a)
        assign(self.weight, w - self.beta * (b.float() @ a.float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _SubspaceGrad.apply(self.weight, self.lora_a, self.lora_b, self.beta)
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
