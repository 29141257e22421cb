"""Correctly rounded division by a constant, the same on every device.

PyTorch's CUDA kernel computes ``tensor / python_scalar`` as ``tensor * (1 / scalar)`` (two
roundings), while the CPU divides (one rounding); and ``scalar / tensor`` becomes
``tensor.reciprocal() * scalar`` everywhere. For constants that are not powers of two (6, 448,
2688) the results differ in the last bit, which breaks bit-exactness between devices and
kernels. These helpers put the constant in a tensor on the operand's device so that the
division is a single IEEE-754 division everywhere (``a / c`` as a kernel writes it).
"""

from __future__ import annotations

import torch


def div(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c``, rounded once."""
    return a / torch.full((), c, dtype=a.dtype, device=a.device)


def rdiv(c: float, a: torch.Tensor) -> torch.Tensor:
    """``c / a``, rounded once."""
    return torch.full((), c, dtype=a.dtype, device=a.device) / a
