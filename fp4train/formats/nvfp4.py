"""NVFP4: E2M1 elements, 16-element blocks with an E4M3 scale, one FP32 scale per tensor.

Encode (NVIDIA, arXiv 2509.25149), with ``amax_t`` the tensor's largest finite magnitude:

    s_enc = (448 * 6) / amax_t                    # FP32; maps amax_t to E4M3max * E2M1max
    sb    = e4m3((amax_b / 6) * s_enc)            # per block; the division by 6 first
    q     = e2m1((x * s_enc) / sb)                # per element; two roundings, this order
    x'    = (q * sb) / s_enc                      # decode (q * sb is exact)

The float order above is load-bearing for bit-exactness: kernels must use the same.
Edge cases: an all-zero tensor uses ``s_enc = 1``; a tiny ``amax_t`` whose ``s_enc`` would
overflow is capped at the FP32 maximum; a block whose ``sb`` rounds to 0 (its amax below
about ``2**-10 * amax_t / 448``) is flushed to zero; a block holding NaN/Inf gets the E4M3
NaN scale (decodes to NaN), and ``amax_t`` is taken over finite values only.

Stochastic rounding never saturates: E2M1's SR is unbiased only on ``[-6, 6]``, and a block whose
E4M3 scale rounded *down* maps its largest element past 6, where it would be clipped (a bias of up
to 1/16 of that element, always towards zero). Under SR such a block - ``(amax_b * s_enc) / sb > 6``,
the same float as its largest scaled element - takes the next larger E4M3 scale (one code up; at
most 448, which cannot overflow since ``amax_b <= amax_t``), so every scaled element is at most 6 and
``E[q] = x``. Round-to-nearest keeps the nearest scale (a clipped maximum is nearer than a coarser
block).

"4/6" block scaling (Cook et al. 2025, ``four_over_six=True``): each block tries mapping its
max to 6 *and* to 4 and keeps whichever gives the smaller squared error (ties keep 6), each block's
errors summed in a fixed tree (:func:`pairwise_sum`) so that kernels choose alike. The errors
compared are the round-to-nearest ones, also under stochastic rounding: the choice depends on the block
alone, so each block's SR stays unbiased (chosen on the SR draw, the scale would depend on the very
rounding it then applies, and the mean of many draws would miss the input). To make
room for the 4-candidate (whose ``sb`` is 1.5x larger), the tensor scale becomes
``(448 * 4) / amax_t`` in this mode (our choice; documented in docs/formats.md).
"""

from __future__ import annotations

import torch

from . import e2m1, e4m3
from .ieee import div, rdiv, true_div

_FP32_MAX = torch.finfo(torch.float32).max


def tensor_scale(x: torch.Tensor, *, four_over_six: bool = False) -> torch.Tensor:
    """FP32 encode scale ``s_enc`` (0-d tensor) from the finite values of ``x`` (1 for an empty ``x``)."""
    return scale_from_amax(finite_amax(x), four_over_six=four_over_six)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (FP32, 0-d; 0 for an empty ``x``): what the tensor scale is made from."""
    xf = x.float()
    if xf.numel() == 0:
        return torch.zeros((), device=x.device)
    return torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf)).amax()


def scale_from_amax(amax: torch.Tensor, *, four_over_six: bool = False) -> torch.Tensor:
    """``s_enc`` from the tensor's finite amax (FP32, 0-d): ``(448 * 6) / amax`` (4 with 4/6), 1 for amax 0."""
    top = 448.0 * (4.0 if four_over_six else 6.0)
    s = rdiv(top, amax).clamp(max=_FP32_MAX)
    return torch.where(amax == 0, torch.ones_like(s), s)


def block_scales(amax_b: torch.Tensor, s_enc: torch.Tensor, target: float = 6.0, *, stochastic: bool = False):
    """(E4M3 codes, values) of the block scales ``e4m3((amax_b / target) * s_enc)``; with ``stochastic``
    one code up where that scale would map the block's largest element past 6 (see the module docstring)."""
    codes = e4m3.encode(div(amax_b, target) * s_enc)
    sb = e4m3.decode(codes)
    if stochastic:
        over = (sb > 0) & (true_div(amax_b * s_enc, torch.where(sb > 0, sb, torch.ones_like(sb))) > 6.0)
        over = over & (codes < e4m3.E4M3_MAX_CODE)
        codes = torch.where(over, codes + 1, codes)
        sb = torch.where(over, e4m3.decode(codes), sb)
    return codes, sb


def _encode_with(xb, amax_b, s_enc, target: float, u):
    sb_codes, sb = block_scales(amax_b, s_enc, target, stochastic=u is not None)
    sb = sb.unsqueeze(-1)
    v = true_div(xb * s_enc, sb)
    v = torch.where(sb == 0, torch.zeros_like(v), v)
    codes = e2m1.encode_nearest(v) if u is None else e2m1.encode_stochastic(v, u)
    return codes, sb_codes, sb


def pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim (a power of two) as a fixed tree: neighbours first (``t[2i] + t[2i+1]``), then
    neighbouring sums, and so on - one float result on every device and in every kernel (a library's reduction
    order is its own, and 4/6's choice compares two such sums)."""
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t.squeeze(-1)


def encode_blocks(
    xb: torch.Tensor,
    s_enc: torch.Tensor,
    *,
    u: torch.Tensor | None,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked float32 ``(*scale_shape, 16)`` -> (E2M1 codes, E4M3 scale bytes)."""
    finite = torch.isfinite(xb)
    nan_block = ~finite.all(dim=-1)
    xb = torch.where(finite, xb, torch.zeros_like(xb))
    amax_b = xb.abs().amax(dim=-1)
    codes, sb_codes, sb = _encode_with(xb, amax_b, s_enc, 6.0, u)
    if four_over_six:
        codes4, sb_codes4, sb4 = _encode_with(xb, amax_b, s_enc, 4.0, u)
        # the choice is made on the nearest encodings, so it depends on the block alone, never on a rounding draw
        near6 = (codes, sb) if u is None else _encode_with(xb, amax_b, s_enc, 6.0, None)[::2]
        near4 = (codes4, sb4) if u is None else _encode_with(xb, amax_b, s_enc, 4.0, None)[::2]
        err6 = pairwise_sum((true_div(e2m1.decode(near6[0]) * near6[1], s_enc) - xb).square())
        err4 = pairwise_sum((true_div(e2m1.decode(near4[0]) * near4[1], s_enc) - xb).square())
        use4 = err4 < err6
        codes = torch.where(use4.unsqueeze(-1), codes4, codes)
        sb_codes = torch.where(use4, sb_codes4, sb_codes)
    codes = torch.where(nan_block.unsqueeze(-1), torch.zeros_like(codes), codes)
    sb_codes = torch.where(nan_block, torch.full_like(sb_codes, e4m3.E4M3_NAN_CODE), sb_codes)
    return codes, sb_codes
