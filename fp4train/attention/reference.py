"""Full-Stack FP4's quantized attention in plain PyTorch: the reference the Triton kernel is tested against.

Of attention's seven products (forward ``S = Q K^T``, ``O = P V``; backward the recompute of ``S``,
``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``, ``dK = dS^T Q``), the paper's mixed-precision scheme
(section 3.5) quantizes Q, K, V and dS to NVFP4 and keeps P and dO in BF16:

* Q, K and V are quantized once (1x16 blocks along the head dim, one FP32 scale per tensor) and the same
  quantized tensors serve the forward and the backward (the paper's tensor reuse: the backward sees the
  numbers the forward used). So ``S = Q^ K^^T``, ``dQ = dS^ K^`` and ``dK = dS^^T Q^`` multiply NVFP4 operands;
  ``O = P V^`` and ``dP = dO V^^T`` multiply a quantized V by BF16 P and dO (METHODS.md lists V with the BF16
  paths; the paper quantizes it, and so do we); ``dV = P^T dO`` is BF16 on both sides.
* dS is quantized once per backward to NVFP4 with 1x16 blocks along the key axis and, in place of the
  per-tensor scale, one FP32 scale per 64x64 tile (``TILE``): a fused kernel sees a tile, not the tensor.
  The same dS^ serves dQ and dK.
* Gradients pass straight through the quantizers to Q, K and V, as in fp4train's linear layers.

Quantized operands are carried as exact BF16 values (``q * sb``: E2M1 times E4M3) and a divisor (the
tensor's or tile's FP32 scale), so a BF16 tensor-core product of values is exact and the divisors fold into
the softmax scale and the outputs. Softmax and accumulation are FP32; P is rounded to BF16 before ``P V``
and ``P^T dO``, as flash attention does. Shapes: ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` with ``H`` a
multiple of ``Hkv`` (grouped-query attention); causal or not.
"""

from __future__ import annotations

import math

import torch

from ..formats import e2m1, nvfp4
from ..formats.ieee import true_div
from ..formats.quantize import quantize
from ..quantizer import kernels_usable_on

#: dS's second-level scale covers one TILE x TILE tile (the kernel's block of queries x keys)
TILE = 64
BLOCK = 16  # NVFP4's block along the inner dimension


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 (1x16 along the last dim, one scale for the tensor) of ``x [..., D]``: (exact BF16 values ``q * sb``,
    FP32 divisor ``s_enc``); the dequantized tensor is ``values / s_enc``."""
    d = x.shape[-1]
    if x.is_cuda and kernels_usable_on(x):  # the Triton kernel with the reference's bits (fp4train.kernels.nvfp4_values)
        from ..kernels.nvfp4_values import nvfp4_values

        sb = nvfp4_values(x.reshape(-1, d), axis=1)
        return sb.values.reshape(x.shape), sb.divisor.float().reshape(())
    sb = quantize(x.reshape(-1, d), "nvfp4", axis=1).scaled_bf16()
    return sb.values.reshape(x.shape), sb.divisor.float().reshape(())


def quantize_ds(ds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of ``ds [..., Tq, Tk]`` with 1x16 blocks along the keys and one FP32 scale per TILE x TILE tile (tiles
    from the origin, zero padding): (exact values ``q * sb`` in FP32, each element's tile divisor ``s_enc``)."""
    *lead, tq, tk = ds.shape
    pq, pk = -tq % TILE, -tk % TILE
    x = torch.nn.functional.pad(ds.float(), (0, pk, 0, pq))
    nq, nk = x.shape[-2] // TILE, x.shape[-1] // TILE
    tiles = x.reshape(*lead, nq, TILE, nk, TILE)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nq, nk]
    s_enc = nvfp4.scale_from_amax(amax)
    xb = tiles.reshape(*lead, nq, TILE, nk, TILE // BLOCK, BLOCK)
    s_b = s_enc[..., :, None, :, None]  # per block
    _, sb = nvfp4.block_scales(xb.abs().amax(dim=-1), s_b)  # NVFP4's float order, tile scale for tensor scale
    sb = sb[..., None]
    v = true_div(xb * s_b[..., None], sb)
    v = torch.where(sb == 0, torch.zeros_like(v), v)
    values = e2m1.decode(e2m1.encode_nearest(v)) * sb
    div = s_b[..., None].expand_as(values)
    values = values.reshape(x.shape)[..., :tq, :tk]
    div = div.reshape(x.shape)[..., :tq, :tk]
    return values, div


def _expand(kv: torch.Tensor, vv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V in FP32 with each kv head repeated for the query heads of its group (grouped-query attention)."""
    g = heads // kv.shape[1]
    return tuple(x.repeat_interleave(g, dim=1).float() if g > 1 else x.float() for x in (kv, vv))


def _scores(qv, k, dq, dk, *, causal: bool, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``S = Q^ K^^T * scale`` in FP32 (the divisors folded into the scale), -inf above the causal diagonal and where
    ``mask`` (bool, broadcast to ``[B, H, Tq, Tk]``, True: attend) is False."""
    s = (qv.float() @ k.mT) * (scale / (dq * dk))
    if causal:
        tq, tk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool, device=s.device).tril(tk - tq), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``P = exp(S - LSE)``; a query that may attend to no key (a padding row of a mask) gets P = 0, so its output
    and its gradients are 0, not NaN."""
    return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])


def forward(qv, kv, vv, dq, dk, dv, *, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """``(O [B, H, T, D] bf16, LSE [B, H, T] fp32)`` of quantized values and their divisors (see the module docstring);
    ``mask``: bool ``[B or 1, H or 1, Tq, Tk]``, True where a query may attend to a key (padding, sliding windows)."""
    k, v = _expand(kv, vv, qv.shape[1])
    s = _scores(qv, k, dq, dk, causal=causal, scale=scale, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    p = _probs(s, lse)
    o = (p.to(torch.bfloat16).float() @ v) / dv
    return o.to(torch.bfloat16), lse


def backward(do, o, lse, qv, kv, vv, dq, dk, dv, *, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """``(dQ, dK, dV)`` in FP32 for the upstream gradient ``do`` (see the module docstring)."""
    g = qv.shape[1] // kv.shape[1]
    k, v = _expand(kv, vv, qv.shape[1])
    p = _probs(_scores(qv, k, dq, dk, causal=causal, scale=scale, mask=mask), lse)
    do16 = do.to(torch.bfloat16).float()
    d_v = p.to(torch.bfloat16).float().mT @ do16
    dp = (do16 @ v.mT) / dv
    delta = (do16 * o.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dsv, dsd = quantize_ds(ds)
    ds_hat = dsv / dsd
    d_q = (ds_hat @ k) * (scale / dk)
    d_k = (ds_hat.mT @ qv.float()) * (scale / dq)
    if g > 1:
        b, h, t, d = d_k.shape
        d_k = d_k.reshape(b, h // g, g, t, d).sum(2)
        d_v = d_v.reshape(b, h // g, g, t, d).sum(2)
    return d_q, d_k, d_v


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
