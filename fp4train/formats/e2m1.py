"""E2M1, the 4-bit float element of MXFP4 and NVFP4.

Bits ``s ee m`` (1 sign, 2 exponent with bias 1, 1 mantissa). The eight magnitudes, in code
order, are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``: the code of a magnitude is its index in
:data:`E2M1_GRID`, and the sign is bit 3. There is no Inf and no NaN; magnitudes above 6
saturate to 6. ``-0`` is code ``0b1000`` and decodes to ``-0.0``.

Two codes pack into one byte: element ``2i`` in the low nibble, ``2i+1`` in the high nibble
(the order used by OCP MX, PyTorch's ``float4_e2m1fn_x2`` and cuBLAS).

Functions here take values already divided by their block scale; they know nothing of
blocks. NaN handling belongs to the block level (a block holding NaN/Inf gets a NaN scale),
so these functions map NaN to code 0 and leave the flagging to the caller.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
#: Magnitudes in code order; code ``c`` (0..7) has magnitude ``E2M1_GRID[c]``.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even as seven threshold tests. Between grid points g[i] and g[i+1] the
# midpoint goes to whichever code is even (mantissa bit 0): codes 0,2,4,6 are even.
# (midpoint, goes_up_on_tie): 0.25 -> 0 (code 0 even), 0.75 -> 1 (code 2), 1.25 -> 1,
# 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_RTNE_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _grid(like: torch.Tensor) -> torch.Tensor:
    """The eight magnitudes (float32, code order) on ``like``'s device, computed from the code bits on every call
    (exact: halves and powers of two). Nothing is kept between calls: a table kept would be made inside whatever
    first needs it - a compiler's trace (a fake tensor a later trace refuses) or a CUDA-graph warm-up (an
    allocation in the graph's memory pool that no output tracks, which the pool refuses) - and a host-to-device
    copy made per call is refused inside a CUDA-graph capture."""
    code = torch.arange(8, dtype=torch.int32, device=like.device)
    e, m = code >> 1, (code & 1).to(torch.float32)
    return torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << e).to(torch.float32) * 0.5)


def encode_nearest(v: torch.Tensor) -> torch.Tensor:
    """Float32 values -> E2M1 codes (uint8, 0..15), round to nearest, ties to even.

    ``|v| > 6`` saturates to 6; NaN maps to +0 (the caller flags the block).
    """
    a = v.abs()
    idx = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, up_on_tie in _RTNE_THRESHOLDS:
        idx += (a >= mid) if up_on_tie else (a > mid)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def encode_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Float32 values -> E2M1 codes with stochastic rounding driven by uniforms ``u`` in [0,1).

    For ``g[i] <= |v| < g[i+1]`` the result is ``g[i+1]`` with probability
    ``(|v| - g[i]) / (g[i+1] - g[i])``, else ``g[i]``, so ``E[q] = v`` inside the grid;
    it is never more than one grid step from ``v``. ``|v| >= 6`` saturates to 6 (biased:
    use the ``ceil`` scale rule so nothing exceeds 6).
    """
    grid = _grid(v)
    a = v.abs().clamp(max=E2M1_MAX).contiguous()
    # lower neighbour index: number of grid points <= a, minus one
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)
    g_lo = grid[lo]
    step = grid[lo + 1] - g_lo
    p_up = (a - g_lo) / step  # exact: step is a power of two
    idx = (lo + (u < p_up).to(lo.dtype)).to(torch.uint8)
    idx = torch.where(torch.isnan(v), torch.zeros_like(idx), idx)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32 values (``-0.0`` for code 8)."""
    mag = _grid(codes)[(codes & 7).long()]
    sign = (codes >> 3).to(torch.bool)
    return torch.where(sign, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim, two per byte (even index in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: bytes -> codes, the last dim doubled."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
