"""Full-Stack FP4's quantized attention: QK^T, dS K and dS^T Q on NVFP4 operands, P V and dO V^T with BF16 P/dO.

>>> from fp4train.attention import nvfp4_attention
>>> y = nvfp4_attention(q, k, v, causal=True)        # q [B, H, T, D], k/v [B, Hkv, T, D]

The numerics are defined by :mod:`fp4train.attention.reference` (plain PyTorch, any device); on a CUDA GPU the
Triton kernels of :mod:`fp4train.kernels.attention` run the same numerics (``impl="auto"``). Switch a model
to it with :func:`set_attention` (fp4train's Llama and Hugging Face Llama-style models), or through a recipe's
``attention="nvfp4"`` field, which :func:`fp4train.convert` applies.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..quantizer import kernels_usable_on
from . import reference
from .reference import TILE, default_scale, quantize_ds, quantize_heads

KINDS = ("sdpa", "nvfp4")
_IMPLS = ("auto", "reference", "triton")
HEAD_DIMS = (32, 64, 128)


def _use_triton(impl: str, q: torch.Tensor) -> bool:
    if impl == "triton":
        return True
    return impl == "auto" and q.is_cuda and kernels_usable_on(q)


# The attention as torch.library ops (as the quantized linear is): eager calls and torch.compile run the same code,
# and a compiled model keeps its attention inside the graph (no graph break, CUDA graphs across it). The forward
# returns what the backward reads - the quantized Q, K, V with their divisors, the output and the log-sum-exp - so
# the backward sees the numbers the forward used (the paper's tensor reuse).

@torch.library.custom_op("fp4train::nvfp4_attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, impl: str) -> list[torch.Tensor]:
    """``[O (bf16), LSE, Q^, K^, V^, s_q, s_k, s_v]`` of :func:`nvfp4_attention` (checked arguments)."""
    (qv, dq), (kv, dk), (vv, dv) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    qv, kv, vv = qv.contiguous(), kv.contiguous(), vv.contiguous()
    if _use_triton(impl, q):
        from ..kernels import attention as kernel

        o, lse = kernel.forward(qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    else:
        o, lse = reference.forward(qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    return [o, lse, qv, kv, vv, dq.clone(), dk.clone(), dv.clone()]


@attention_op.register_fake
def _(q, k, v, causal, scale, impl):
    b, h, t, d = q.shape
    scalar = q.new_empty((), dtype=torch.float32)
    return [q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty((b, h, t), dtype=torch.float32),
            q.new_empty(q.shape, dtype=torch.bfloat16), k.new_empty(k.shape, dtype=torch.bfloat16),
            v.new_empty(v.shape, dtype=torch.bfloat16), scalar, torch.empty_like(scalar), torch.empty_like(scalar)]


@torch.library.custom_op("fp4train::nvfp4_attention_backward", mutates_args=())
def attention_backward_op(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, qv: torch.Tensor, kv: torch.Tensor,
                          vv: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
                          impl: str) -> list[torch.Tensor]:
    """``[dQ, dK, dV]`` in FP32 from what :func:`attention_op` returned."""
    if _use_triton(impl, qv):
        from ..kernels import attention as kernel

        grads = kernel.backward(do, o, lse, qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    else:
        grads = reference.backward(do, o, lse, qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    return [g.float().contiguous() for g in grads]


@attention_backward_op.register_fake
def _(do, o, lse, qv, kv, vv, dq, dk, dv, causal, scale, impl):
    return [qv.new_empty(qv.shape, dtype=torch.float32), kv.new_empty(kv.shape, dtype=torch.float32),
            vv.new_empty(vv.shape, dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, impl = inputs
    ctx.save_for_backward(*output)
    ctx.causal, ctx.scale, ctx.impl, ctx.dtypes = causal, scale, impl, (q.dtype, k.dtype, v.dtype)


def _backward(ctx, grads_out):
    do = grads_out[0]  # only O carries a gradient: the other outputs are what the backward reads
    o, lse, qv, kv, vv, dq, dk, dv = ctx.saved_tensors
    grads = torch.ops.fp4train.nvfp4_attention_backward(do, o, lse, qv, kv, vv, dq, dk, dv, ctx.causal, ctx.scale, ctx.impl)
    return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes)) + (None, None, None)


torch.library.register_autograd("fp4train::nvfp4_attention", _backward, setup_context=_setup_context)


def nvfp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """Attention with Full-Stack FP4's numerics (module docstring of :mod:`.reference`); output ``[B, H, T, D]``
    in ``q``'s dtype. ``impl``: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"reference"``, ``"triton"``."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"nvfp4_attention takes q [B, H, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: same batch, length and head dim, and q's heads "
                         "a multiple of k's (grouped-query attention)")
    if d % 16:
        raise ValueError(f"head dim {d} is not a multiple of 16 (NVFP4 blocks)")
    if _use_triton(impl, q) and d not in HEAD_DIMS:
        raise ValueError(f"the Triton attention kernel takes head dims {HEAD_DIMS}, got {d}; use impl='reference'")
    o = torch.ops.fp4train.nvfp4_attention(q, k, v, causal, default_scale(d) if scale is None else float(scale), impl)[0]
    return o.to(q.dtype)


def set_attention(model: nn.Module, kind: str) -> int:
    """Give ``model``'s attention ``kind``'s numerics (``"sdpa"``: the model's own, ``"nvfp4"``): fp4train's Llama
    (its ``Attention`` modules), and Hugging Face models with an attention interface (``config._attn_implementation``).
    Returns the number of attention modules switched; raises if ``model`` has none that it can switch."""
    if kind not in KINDS:
        raise ValueError(f"attention must be one of {KINDS}, got {kind!r}")
    n = 0
    for m in model.modules():
        if switchable(m):
            m.attention = kind
            n += 1
    config = getattr(model, "config", None)
    if n == 0 and config is not None and hasattr(config, "_attn_implementation"):
        if kind == "nvfp4":
            register_hf()
        config._attn_implementation = HF_NAME if kind == "nvfp4" else "sdpa"
        n = sum(1 for name, _ in model.named_modules() if name.endswith("self_attn"))
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no attention fp4train can switch: it knows fp4train's Llama and Hugging "
                         "Face models with an attention interface; call fp4train.attention.nvfp4_attention in your own")
    return n


def switchable(module: nn.Module) -> bool:
    """Does ``module`` pick its attention by an ``attention`` attribute naming one of :data:`KINDS` (fp4train's
    Llama ``Attention`` does)?"""
    return getattr(module, "attention", None) in KINDS


HF_NAME = "fp4train_nvfp4"


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Hugging Face's attention interface: ``[B, H, T, D]`` in, ``([B, T, H, D], None)`` out (causal, no padding mask)."""
    if dropout:
        raise ValueError("fp4train's NVFP4 attention has no dropout; set attention_dropout=0")
    o = nvfp4_attention(query, key, value, causal=getattr(module, "is_causal", True), scale=scaling)
    return o.transpose(1, 2).contiguous(), None


def register_hf() -> None:
    """Register :func:`nvfp4_attention` with transformers' ``AttentionInterface`` as ``"fp4train_nvfp4"``."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, _hf_attention)


__all__ = ["HF_NAME", "KINDS", "TILE", "nvfp4_attention", "quantize_ds", "quantize_heads", "register_hf", "set_attention"]
