"""Block Walsh-Hadamard transforms (plain PyTorch reference).

``H_b`` is the ``b x b`` Sylvester Walsh-Hadamard matrix scaled by ``1/sqrt(b)``:
``H_1 = [1]``, ``H_2b = [[H_b, H_b], [H_b, -H_b]] / sqrt(2)``. It is symmetric and
orthogonal, ``H_b H_b = I``, so it is its own inverse.

A block transform along an axis splits that axis into chunks of ``b`` and multiplies each
chunk by ``H_b``. The randomized version (RHT) first multiplies each chunk elementwise by a
seeded sign vector ``d`` (the same ``d`` for every chunk): ``y = (x * d) H_b``, whose exact
inverse is ``x = (y H_b) * d``.

Inside a GEMM ``C = A B^T`` with inner dimension K, transforming both operands along K with
the same ``H`` (and the same signs) leaves the product unchanged in exact arithmetic:
``(A D H)(B D H)^T = A D H H^T D B^T = A B^T`` - the *inner* Hadamard transform (IHT).
What changes is the distribution each block-scaled quantizer sees: outliers are spread
over ``b`` elements.

Computed with ``log2(b)`` butterfly stages in FP32 (``(u, v) -> (u + v, u - v)``), then one
multiplication by ``1/sqrt(b)``; the result is cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch

from .. import counter_rng

MIN_BLOCK, MAX_BLOCK = 2, 256


def hadamard_matrix(b: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The normalized dense ``H_b`` (the definition the fast transform is tested against)."""
    _check_block(b)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(dtype=dtype, device=device)


def signs(seed: int | torch.Tensor, b: int, device=None) -> torch.Tensor:
    """The RHT sign vector ``d`` (float32 +-1, length ``b``) for ``seed``; device-independent. ``seed`` may also be
    its keys as an int64 tensor ``[key, key2]`` (a seed that lives on a device: the same signs, made there)."""
    if isinstance(seed, torch.Tensor):
        return counter_rng.random_signs_keys(seed, b, device=device)
    return counter_rng.random_signs(seed, b, device=device)


def hadamard(
    x: torch.Tensor,
    block: int = 32,
    axis: int = -1,
    seed: int | torch.Tensor | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Normalized block Walsh-Hadamard transform of ``x`` along ``axis``.

    Args:
        x: a floating-point tensor; ``x.shape[axis]`` must be a multiple of ``block``.
        block: transform size, a power of two in [2, 256] (16..256 are the useful ones).
        axis: the axis to transform (a GEMM's inner dimension).
        seed: ``None`` for the plain transform; an int for the randomized transform (RHT)
            with seeded random signs (or that seed's keys as an int64 tensor ``[key, key2]``, see :func:`signs`).
        inverse: apply the exact inverse (for RHT the signs are applied after ``H``).
    """
    check_request(x, block, axis)
    d = signs(seed, block, device=x.device) if seed is not None else None
    return hadamard_tensors(x, d, block=block, axis=axis, inverse=inverse)


def check_request(x, block: int, axis: int) -> None:
    """Validate a :func:`hadamard` request: a one-line error naming the culprit otherwise."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"hadamard expects a floating-point tensor, got {got}")
    _check_block(block)
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for a tensor of shape {tuple(x.shape)}")
    n = x.shape[axis]
    if n % block:
        raise ValueError(
            f"hadamard: dimension {axis} has size {n}, not a multiple of block={block}; "
            f"pad it or pick a block that divides it"
        )


def hadamard_tensors(x: torch.Tensor, d: torch.Tensor | None, *, block: int, axis: int, inverse: bool = False,
                     core=None) -> torch.Tensor:
    """:func:`hadamard` for a checked request, the signs given as a tensor (or None): a function
    of tensors that a fused path can trace. ``core``: the numerical core, :func:`block_transform`
    unless given (a compiled copy of it)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work).movedim(axis, -1)
    lead = y.shape[:-1]
    n = y.shape[-1]
    y = y.reshape(*lead, n // block, block)
    y = (core or block_transform)(y, d.to(work) if d is not None else None, inverse)
    return y.reshape(*lead, n).movedim(-1, axis).to(x.dtype)


def block_transform(y: torch.Tensor, d: torch.Tensor | None, inverse: bool) -> torch.Tensor:
    """``y`` ``[..., b]`` -> ``(y * d) H_b`` (or its inverse ``(y H_b) * d``): the numerical core,
    a function of tensors that a fused path can compile (same float order, same bits)."""
    if d is not None and not inverse:
        y = y * d
    y = _fwht(y) * (1.0 / math.sqrt(y.shape[-1]))
    if d is not None and inverse:
        y = y * d
    return y


def _fwht(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (a power of two)."""
    b = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < b:
        t = y.reshape(*lead, b // (2 * h), 2, h)
        u, v = t[..., 0, :], t[..., 1, :]
        y = torch.stack([u + v, u - v], dim=-2).reshape(*lead, b)
        h *= 2
    return y


def _check_block(b) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or b < MIN_BLOCK or b > MAX_BLOCK or b & (b - 1):
        raise ValueError(f"Hadamard block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {b!r}")
