"""Full-Stack FP4's quantized attention: QK^T, dS K and dS^T Q on NVFP4 operands, P V and dO V^T with BF16 P/dO.

>>> from fp4train.attention import nvfp4_attention
>>> y = nvfp4_attention(q, k, v, causal=True)        # q [B, H, T, D], k/v [B, Hkv, T, D]

The numerics are defined by :mod:`fp4train.attention.reference` (plain PyTorch, any device); on a CUDA GPU the
Triton kernels of :mod:`fp4train.kernels.attention` run the same numerics (``impl="auto"``). Switch a model
to it with :func:`set_attention` (fp4train's Llama and Hugging Face Llama-style models), or through a recipe's
``attention="nvfp4"`` field, which :func:`fp4train.convert` applies.
"""

from __future__ import annotations

import warnings
from typing import Optional

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
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], causal: bool, scale: float,
                 impl: str) -> list[torch.Tensor]:
    """``[O (bf16), LSE, Q^, K^, V^, s_q, s_k, s_v]`` of :func:`nvfp4_attention` (checked arguments)."""
    (qv, dq), (kv, dk), (vv, dv) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    qv, kv, vv = qv.contiguous(), kv.contiguous(), vv.contiguous()
    if mask is None and _use_triton(impl, q):
        from ..kernels import attention as kernel

        o, lse = kernel.forward(qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    else:
        o, lse = reference.forward(qv, kv, vv, dq, dk, dv, causal=causal, scale=scale, mask=mask)
    return [o, lse, qv, kv, vv, dq, dk, dv]


@attention_op.register_fake
def _(q, k, v, mask, causal, scale, impl):
    b, h, t, d = q.shape
    scalar = q.new_empty((), dtype=torch.float32)
    return [q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty((b, h, t), dtype=torch.float32),
            q.new_empty(q.shape, dtype=torch.bfloat16), k.new_empty(k.shape, dtype=torch.bfloat16),
            v.new_empty(v.shape, dtype=torch.bfloat16), scalar, torch.empty_like(scalar), torch.empty_like(scalar)]


@torch.library.custom_op("fp4train::nvfp4_attention_backward", mutates_args=())
def attention_backward_op(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, qv: torch.Tensor, kv: torch.Tensor,
                          vv: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, mask: Optional[torch.Tensor],
                          causal: bool, scale: float, impl: str) -> list[torch.Tensor]:
    """``[dQ, dK, dV]`` in FP32 from what :func:`attention_op` returned."""
    if mask is None and _use_triton(impl, qv):
        from ..kernels import attention as kernel

        grads = kernel.backward(do, o, lse, qv, kv, vv, dq, dk, dv, causal=causal, scale=scale)
    else:
        grads = reference.backward(do, o, lse, qv, kv, vv, dq, dk, dv, causal=causal, scale=scale, mask=mask)
    return [g.float().contiguous() for g in grads]


@attention_backward_op.register_fake
def _(do, o, lse, qv, kv, vv, dq, dk, dv, mask, causal, scale, impl):
    return [qv.new_empty(qv.shape, dtype=torch.float32), kv.new_empty(kv.shape, dtype=torch.float32),
            vv.new_empty(vv.shape, dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    q, k, v, mask, causal, scale, impl = inputs
    ctx.save_for_backward(*output, mask)
    ctx.causal, ctx.scale, ctx.impl, ctx.dtypes = causal, scale, impl, (q.dtype, k.dtype, v.dtype)


def _backward(ctx, grads_out):
    do = grads_out[0]  # only O carries a gradient: the other outputs are what the backward reads
    o, lse, qv, kv, vv, dq, dk, dv, mask = ctx.saved_tensors
    grads = torch.ops.fp4train.nvfp4_attention_backward(do, o, lse, qv, kv, vv, dq, dk, dv, mask, ctx.causal, ctx.scale,
                                                        ctx.impl)
    return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes)) + (None, None, None, None)


torch.library.register_autograd("fp4train::nvfp4_attention", _backward, setup_context=_setup_context)


def nvfp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                    impl: str = "auto", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with Full-Stack FP4's numerics (module docstring of :mod:`.reference`); output ``[B, H, T, D]``
    in ``q``'s dtype. ``impl``: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"reference"``, ``"triton"``.
    ``mask``: bool, broadcastable to ``[B, H, T, T]``, True where a query may attend to a key (padding, sliding
    windows; on top of ``causal``); a query with no key to attend to gets a zero output. The Triton kernels take no
    mask: a masked call runs the reference (plain PyTorch, T x T scores in memory), and says so once."""
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
    if mask is not None:
        if mask.dtype != torch.bool or mask.ndim != 4 or any(m not in (1, n) for m, n in zip(mask.shape, (b, h, t, t))):
            raise ValueError(f"mask must be a bool tensor broadcastable to [B, H, T, T] = {[b, h, t, t]}, got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        if impl == "triton":
            raise ValueError("the Triton attention kernels take no mask; use impl='auto' or 'reference' for masked attention")
        if q.is_cuda:
            warnings.warn("fp4train: masked NVFP4 attention (padding or a sliding window) runs the plain-PyTorch reference, "
                          "which holds the T x T scores in memory; unpadded causal batches run the Triton kernels", stacklevel=2)
    elif _use_triton(impl, q) and d not in HEAD_DIMS:
        raise ValueError(f"the Triton attention kernel takes head dims {HEAD_DIMS}, got {d}; use impl='reference'")
    o = torch.ops.fp4train.nvfp4_attention(q, k, v, mask, causal, default_scale(d) if scale is None else float(scale), impl)[0]
    return o.to(q.dtype)


def set_attention(model: nn.Module, kind: str) -> int:
    """Give ``model``'s attention ``kind``'s numerics (``"sdpa"``: the model's own - on a Hugging Face model the
    implementation it had before ``"nvfp4"`` - or ``"nvfp4"``): fp4train's Llama (its ``Attention`` modules), and
    Hugging Face models with an attention interface (``config._attn_implementation``), also where one sits inside
    another module (fp4train's trainer wraps them). ``"nvfp4"`` first refuses, before changing anything, a model whose
    attention asks for what the NVFP4 attention does not do (:func:`unsupported`). Returns the number of attention
    modules switched; raises if ``model`` has none that it can switch."""
    if kind not in KINDS:
        raise ValueError(f"attention must be one of {KINDS}, got {kind!r}")
    if kind == "nvfp4" and (problems := unsupported(model)):
        raise AttentionUnsupported(f"{type(model).__name__}'s attention cannot run fp4train's NVFP4 attention: "
                                   + "; ".join(problems))
    n = 0
    for m in model.modules():
        if switchable(m):
            m.attention = kind
            n += 1
    if n == 0:
        for owner, config in hf_configs(model):
            if kind == "nvfp4":
                register_hf()
                if config._attn_implementation != HF_NAME:  # what "sdpa" switches back to (eager, flash, ...), kept on
                    owner.fp4train_attn_before = config._attn_implementation  # the model, not in its saved config
                config._attn_implementation = HF_NAME
            else:
                config._attn_implementation = getattr(owner, "fp4train_attn_before", None) or "sdpa"
            # Hugging Face attention modules say whether they are causal (Llama's self_attn, GPT-2's attn, BERT's self)
            n += sum(1 for m in owner.modules() if m is not owner and isinstance(getattr(m, "is_causal", None), bool))
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no attention fp4train can switch: it knows fp4train's Llama and Hugging "
                         "Face models with an attention interface; call fp4train.attention.nvfp4_attention in your own")
    return n


class AttentionUnsupported(ValueError):
    """A model's attention asks for what fp4train's NVFP4 attention does not do (dropout, soft-capping, sinks)."""


def hf_configs(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """``[(module, config)]``: each Hugging Face config with an attention interface in ``model`` (``model`` itself or
    a module inside it), once, with the outermost module that holds it."""
    seen: dict[int, tuple[nn.Module, object]] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen[id(config)] = (m, config)
    return list(seen.values())


#: a Hugging Face config's attention settings the NVFP4 attention does not implement: (field, its value is a problem)
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def unsupported(model: nn.Module) -> list[str]:
    """What ``model``'s attention asks for that the NVFP4 attention does not do, each with the config field to change:
    attention dropout, logit soft-capping (Gemma 2), attention sinks (gpt-oss). Empty: it can run."""
    out = []
    for _, config in hf_configs(model):
        for name in _DROPOUT_FIELDS:
            v = getattr(config, name, None)
            if isinstance(v, (int, float)) and v > 0:
                out.append(f"attention dropout {name}={v}: set it to 0 in the config")
        v = getattr(config, "attn_logit_softcapping", None)
        if v is not None:
            out.append(f"attention logit soft-capping attn_logit_softcapping={v}: set it to null in the config, or keep "
                       "attention in high precision (a recipe without attention='nvfp4')")
    sinks = [n for n, m in model.named_modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    if sinks:
        out.append(f"attention sinks ({sinks[0]}.sinks{', ...' if len(sinks) > 1 else ''}): keep attention in high precision "
                   "(a recipe without attention='nvfp4')")
    return out


def switchable(module: nn.Module) -> bool:
    """Does ``module`` pick its attention by an ``attention`` attribute naming one of :data:`KINDS` (fp4train's
    Llama ``Attention`` does)?"""
    return getattr(module, "attention", None) in KINDS


HF_NAME = "fp4train_nvfp4"


#: attention arguments Hugging Face models pass that need nothing from the NVFP4 attention: bookkeeping, and
#: ``sliding_window``, which the mask (built as for SDPA, :func:`register_hf`) already holds
_HF_HANDLED = frozenset({"position_ids", "use_cache", "cache_position", "sliding_window", "output_attentions", "past_key_values",
                         "is_causal"})


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Hugging Face's attention interface: ``[B, H, T, D]`` in, ``([B, T, H, D], None)`` out. The mask comes as
    transformers builds it for SDPA: None for plain causal attention (the Triton kernels), else a bool mask
    (padding, sliding windows: the reference). Arguments it cannot honour are refused, naming them."""
    if dropout:
        raise ValueError(f"{type(module).__name__}: fp4train's NVFP4 attention has no dropout, and this model asks for "
                         f"{dropout}: set the config's attention dropout to 0 (attention_dropout, attn_pdrop or "
                         "attention_probs_dropout_prob, whichever the model has)")
    unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in _HF_HANDLED)
    if unsupported:
        raise ValueError(f"{type(module).__name__}: fp4train's NVFP4 attention does not implement the attention "
                         f"argument(s) {unsupported} this model passes; keep its attention in high precision "
                         "(a recipe without attention='nvfp4')")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{type(module).__name__}: fp4train's NVFP4 attention takes as many keys as queries (training "
                         f"without a cache), got {query.shape[2]} queries and {key.shape[2]} keys")
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:  # an additive float mask: 0 where attended
        mask = mask == 0
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    o = nvfp4_attention(query, key, value, causal=causal, scale=scaling, mask=mask)
    return o.transpose(1, 2).contiguous(), None


def register_hf() -> None:
    """Register :func:`nvfp4_attention` with transformers' ``AttentionInterface`` as ``"fp4train_nvfp4"``, and SDPA's mask
    builder for it (``AttentionMaskInterface``: no mask for plain causal attention, a bool mask for padding and sliding
    windows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_NAME, _hf_attention)
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)


__all__ = ["HF_NAME", "KINDS", "AttentionUnsupported", "hf_configs", "unsupported", "TILE", "nvfp4_attention", "quantize_ds", "quantize_heads", "register_hf", "set_attention"]
