"""MX formats (OCP Microscaling v1.0): a power-of-two E8M0 scale per block.

* MXFP4: E2M1 elements, 32-element blocks.
* MXFP8: E4M3 elements, 32-element blocks.

Encode, per block of values ``x`` with largest finite magnitude ``amax``:
``e = scale_exponent(amax)`` (rule ``floor`` or ``ceil``, see :mod:`.scales`), then
``q = round(x * 2**-e)`` onto the element grid. Multiplying by a power of two is exact, so
the only rounding is the element rounding; decode ``q * 2**e`` is exact too.
"""

from __future__ import annotations

import torch

from . import e2m1, e4m3
from .scales import ScaleRule, e8m0_exponent, encode_e8m0, pow2

#: element -> (largest exponent, mantissa of the largest value): max = mantissa * 2**emax
_ELEMENT_MAX = {"e2m1": (2, 1.5), "e4m3": (8, 1.75)}


def encode_blocks(
    xb: torch.Tensor,
    *,
    element: str,
    rule: ScaleRule,
    u: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked float32 ``(*scale_shape, n)`` -> (element codes, E8M0 scale bytes).

    ``u`` (uniforms, same shape as ``xb``) selects stochastic rounding; ``None`` is RTNE.
    A block holding NaN/Inf gets the NaN scale and zero codes.
    """
    finite = torch.isfinite(xb)
    nan_block = ~finite.all(dim=-1)
    amax = torch.where(finite, xb.abs(), torch.zeros_like(xb)).amax(dim=-1)
    emax, mant = _ELEMENT_MAX[element]
    e = e8m0_exponent(amax, emax=emax, emax_mantissa=mant, rule=rule)
    v = xb * pow2(-e).unsqueeze(-1)  # exact: power-of-two scaling
    if element == "e2m1":
        codes = e2m1.encode_nearest(v) if u is None else e2m1.encode_stochastic(v, u)
    else:
        codes = e4m3.encode(v) if u is None else e4m3.encode_stochastic(v, u)
    codes = torch.where(nan_block.unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes, encode_e8m0(e, nan_block)
