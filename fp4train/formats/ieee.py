"""Correctly rounded division, the same on every device and under ``torch.compile``.

Two traps make ``a / b`` differ in the last bit between devices and kernels:

* PyTorch's CUDA kernel computes ``tensor / python_scalar`` as ``tensor * (1 / scalar)`` (two
  roundings), while the CPU divides (one rounding); and ``scalar / tensor`` becomes
  ``tensor.reciprocal() * scalar`` everywhere. :func:`div` and :func:`rdiv` put the constant
  in a tensor on the operand's device so that the division is a single IEEE-754 division.
* Triton's FP32 ``/`` (and so every Inductor-generated GPU kernel) lowers to PTX
  ``div.full.f32``, an approximation within 2 ulp, not ``div.rn.f32``. :func:`true_div`,
  while being traced by ``torch.compile``, divides in FP64 and rounds to FP32: FP64 division
  is IEEE in Triton, and for operands with p = 24 significand bits a quotient rounded first
  to 53 >= 2p + 2 bits and then to 24 bits equals the directly rounded one (double rounding
  is innocuous for +, -, *, / when the wider format has at least 2p + 2 bits; Figueroa 1995).
  In eager mode it is a plain division, which PyTorch rounds correctly on CPU and CUDA.

Divisions by powers of two are exact under any of these and need no helper.
"""

from __future__ import annotations

import torch


def true_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` of two FP32 tensors, rounded once, eager or compiled."""
    if torch.compiler.is_compiling() and a.dtype == torch.float32:
        return (a.double() / b.double()).float()
    return a / b


def div(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c`` for a python constant ``c``, rounded once."""
    return true_div(a, torch.full((), c, dtype=a.dtype, device=a.device))


def rdiv(c: float, a: torch.Tensor) -> torch.Tensor:
    """``c / a`` for a python constant ``c``, rounded once."""
    return true_div(torch.full((), c, dtype=a.dtype, device=a.device), a)
