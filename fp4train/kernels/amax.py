"""Finite absolute maxima in one pass: the statistics behind NVFP4's tensor scale and FP8 rowwise scales.

The reference computes them with torch ops that materialize several full-size temporaries
(``x.float()``, ``isfinite``, ``abs``, ``where``): on a 16384 x 8192 BF16 tensor that made the NVFP4
kernels about 4x slower than the MXFP4 ones (bench/results/quantize_speed-NVIDIA_H200.json). Here one
kernel reads ``x`` once and writes, per index of the kept dim, ``max |x|`` over the finite elements
(NaN and Inf count as 0, as in the reference) and whether any element was not finite. A maximum is
exact in any order, so the results equal the reference's bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .hadamard import norm, transform_cols


@triton.jit
def finite_abs(v):
    """``(|v|, 0)`` where ``v`` is finite, ``(0, 1)`` where it is NaN or Inf (FP32 magnitudes, int32 flags)."""
    a = tl.abs(v.to(tl.float32))
    finite = a < float("inf")  # NaN compares false too
    return tl.where(finite, a, 0.0), tl.where(finite, 0, 1)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, bad_ptr, n_out, n_in, s_out, s_in, OB: tl.constexpr, IB: tl.constexpr):
    """Program i: outer indices i*OB .. +OB, reduced over all n_in inner indices in IB-wide steps."""
    o = tl.program_id(0) * OB + tl.arange(0, OB)
    omask = o < n_out
    amax = tl.zeros([OB], tl.float32)
    bad = tl.zeros([OB], tl.int32)
    for i0 in range(0, n_in, IB):
        i = i0 + tl.arange(0, IB)
        mask = omask[:, None] & (i < n_in)[None, :]
        a, nonfinite = finite_abs(tl.load(x_ptr + o[:, None] * s_out + i[None, :] * s_in, mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.max(a, axis=1))
        bad = tl.maximum(bad, tl.max(nonfinite, axis=1))
    tl.store(amax_ptr + o, amax, mask=omask)
    tl.store(bad_ptr + o, bad, mask=omask)


@triton.jit
def _amax_split_kernel(x_ptr, amax_ptr, bad_ptr, n_out, n_in, s_out, s_in, OB: tl.constexpr, IB: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Program (i, j): outer indices i*OB .. +OB over inner indices j*CHUNK .. +CHUNK in IB-deep steps, merged into
    int32 buffers by atomic max (the FP32 bits of non-negative values order like the integers: exact in any
    order). For a reduction along the strided dim, where one program per outer block leaves the GPU idle."""
    o = tl.program_id(0) * OB + tl.arange(0, OB)
    omask = o < n_out
    amax = tl.zeros([OB], tl.float32)
    bad = tl.zeros([OB], tl.int32)
    for i0 in range(0, CHUNK, IB):
        i = tl.program_id(1) * CHUNK + i0 + tl.arange(0, IB)
        mask = omask[None, :] & (i < n_in)[:, None]
        a, nonfinite = finite_abs(tl.load(x_ptr + o[None, :] * s_out + i[:, None] * s_in, mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.max(a, axis=0))
        bad = tl.maximum(bad, tl.max(nonfinite, axis=0))
    tl.atomic_max(amax_ptr + o, amax.to(tl.int32, bitcast=True), mask=omask)
    tl.atomic_max(bad_ptr + o, bad, mask=omask)


def finite_amax_along(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 2D tensor: (FP32 max |x| over the finite elements along ``dim``, bool "some element
    along ``dim`` is NaN/Inf"), one entry per index of the other dim."""
    if x.ndim != 2 or dim % 2 not in (0, 1):
        raise ValueError(f"finite_amax_along takes a 2D tensor and dim 0 or 1, got {tuple(x.shape)}, dim {dim}")
    red = dim % 2
    n_out, n_in = x.shape[1 - red], x.shape[red]
    s_out, s_in = x.stride(1 - red), x.stride(red)
    if red == 1 and n_in:  # along the rows: one program per 4 rows, the contiguous dim wide in the tile (~50-60 registers)
        amax = torch.empty(n_out, dtype=torch.float32, device=x.device)
        bad = torch.empty(n_out, dtype=torch.int32, device=x.device)
        if n_out:
            _amax_kernel[(triton.cdiv(n_out, 4),)](x, amax, bad, n_out, n_in, s_out, s_in, OB=4, IB=1024, num_warps=4)
        return amax, bad.bool()
    # along the columns: 128 columns a program and the rows split in chunks of 256, merged by atomic max into zeroed
    # buffers (which are also the answer for no rows), so that every SM has work: one program per column block alone
    # leaves most of them idle on a 2048-wide weight
    bits = torch.zeros(2, n_out, dtype=torch.int32, device=x.device)
    if n_out and n_in:
        chunk = 256
        _amax_split_kernel[(triton.cdiv(n_out, 128), triton.cdiv(n_in, chunk))](
            x, bits[0], bits[1], n_out, n_in, s_out, s_in, OB=128, IB=32, CHUNK=chunk, num_warps=4)
    return bits[0].view(torch.float32), bits[1].bool()


@triton.jit
def _hadamard_amax_kernel(x_ptr, d_ptr, amax_ptr, M, K, sx, HAS_D: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
                          NORM: tl.constexpr, ROUND_BF16: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr):
    """Program (i, j): row blocks i*RB .. +RB (B rows each) x columns j*BK .. +BK, each block transformed down its
    columns as :func:`.hadamard.block_hadamard` does it, merged by atomic max into one int32 (the FP32 bits)."""
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    acc = tl.zeros([BK, B], tl.float32)
    for i in range(RB):
        r = (tl.program_id(0) * RB + i) * B + tl.arange(0, B)
        x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=(r < M)[:, None] & (c < K)[None, :], other=0.0)
        a, _ = finite_abs(transform_cols(x, d_ptr, HAS_D, B, BK, LOG_B, NORM, ROUND_BF16))
        acc = tl.maximum(acc, a)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0).to(tl.int32, bitcast=True))


def hadamard_finite_amax(x: torch.Tensor, d: torch.Tensor | None, block: int) -> torch.Tensor:
    """The finite amax (:func:`finite_amax_along`, over every element) of ``fp4train.hadamard(x, block, axis=0)`` with signs ``d`` (float32 ``[block]`` or None) for
    a 2D float32/bfloat16 ``x`` whose dim 0 is a multiple of ``block``, without the transformed tensor written: the
    transform is recomputed in registers (the same bits as the Triton transform, rounded to ``x``'s dtype)."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16) or block < 2 or block & (block - 1) or x.shape[0] % block:
        raise ValueError(f"hadamard_finite_amax takes a 2D float32/bfloat16 tensor whose dim 0 is a multiple of the "
                         f"power-of-two block {block}, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    m, k = x.shape
    if m and k:
        bk, rb = 128, 4  # 4 row blocks of 16 a program: 1.1-1.4x faster than one on the H200 (16384 x 2048/8192 BF16)
        if d is not None:
            d = d.to(device=x.device, dtype=torch.float32).contiguous()
        _hadamard_amax_kernel[(triton.cdiv(m // block, rb), triton.cdiv(k, bk))](
            x, d if d is not None else x, bits, m, k, x.stride(0), HAS_D=d is not None, B=block,
            LOG_B=int(math.log2(block)), NORM=norm(block), ROUND_BF16=x.dtype == torch.bfloat16, BK=bk, RB=rb, num_warps=4)
    return bits.view(torch.float32).reshape(())
