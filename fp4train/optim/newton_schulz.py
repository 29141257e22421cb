"""Newton-Schulz orthogonalization (Muon's update), with its matmuls in BF16 or on NVFP4 operands.

For ``G`` ``[m, n]`` (transposed first if ``m > n``), ``X = G / ||G||_F`` and ``ns_steps`` times

    A = X X^T          B = b A + c A A          X = a X + B X

which pushes every singular value of ``X`` towards 1 (the quintic ``a s + b s^3 + c s^5``). ``matmul="bf16"`` is
``torch.optim.Muon``'s iteration, bit for bit. ``matmul="nvfp4"`` (Full-Stack FP4's native NVFP4 Newton-Schulz)
quantizes both operands of every product to NVFP4 along the product's inner dimension (1x16 blocks, E4M3 block
scales, nearest rounding) and multiplies the quantized values with FP32 accumulation; the additions stay in FP32.
NVFP4's error in the iteration's products moves where the quintic lands, so its coefficients are chosen for it
(:data:`NVFP4_COEFFICIENTS`, ``bench/ns_coefficients.py``).
"""

from __future__ import annotations

import torch

from ..formats.quantize import quantize

#: torch.optim.Muon's (a, b, c)
BF16_COEFFICIENTS = (3.4445, -4.775, 2.0315)
#: the best of a coarse grid for NVFP4 products (bench/ns_coefficients.py): with Muon's own the iteration diverges
NVFP4_COEFFICIENTS = (3.0, -4.775, 2.3)


def _nvfp4_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` with both operands NVFP4 along the inner dim (x's rows, y's columns), FP32 accumulation."""
    qx = quantize(x.float(), "nvfp4", axis=1).dequantize(torch.float32)
    qy = quantize(y.float(), "nvfp4", axis=0).dequantize(torch.float32)
    return qx @ qy


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float] = BF16_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, *, matmul: str = "bf16") -> torch.Tensor:
    """The orthogonalized ``g`` (2D): BF16 for ``matmul="bf16"``, FP32 for ``"nvfp4"`` (see the module docstring)."""
    if g.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2D matrix, got shape {tuple(g.shape)}")
    if matmul not in ("bf16", "nvfp4"):
        raise ValueError(f"matmul must be bf16 or nvfp4, got {matmul!r}")
    a, b, c = coefficients
    if matmul == "bf16":  # torch.optim.Muon's _zeropower_via_newtonschulz, in its order
        x = g.bfloat16()
        if g.size(0) > g.size(1):
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
        return x.T if g.size(0) > g.size(1) else x
    x = g.float()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    if x.shape[0] % 16 or x.shape[1] % 16:
        raise ValueError(f"nvfp4 Newton-Schulz needs both dims a multiple of 16 (NVFP4 blocks), got {tuple(g.shape)}")
    for _ in range(steps):
        gram = _nvfp4_mm(x, x.T)
        update = b * gram + c * _nvfp4_mm(gram, gram)
        x = a * x + _nvfp4_mm(update, x)
    return x.T if g.size(0) > g.size(1) else x
