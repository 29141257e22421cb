"""Flash attention forward and backward in Triton with Full-Stack FP4's quantized products.

The numerics are :mod:`fp4train.attention.reference`'s: Q, K, V arrive as exact BF16 values of their NVFP4
quantization with FP32 divisors (folded into the softmax scale and the outputs), P and dO stay BF16, and the
backward quantizes each 64x64 tile of dS to NVFP4 (1x16 blocks along the keys, one FP32 scale per tile, the
block scales and E2M1 rounding of :mod:`.nvfp4_quantize`) before ``dQ = dS K`` and ``dK = dS^T Q``. Every
product of values is exact on BF16 tensor cores; the kernels differ from the reference only in FP32
summation order (online softmax, tiled accumulation, atomic dQ adds - or, under
``torch.use_deterministic_algorithms``, per-key-tile dQ partials summed in a fixed order).

Layout: ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` contiguous, ``H = G * Hkv``. Forward: one program per
(64 queries, batch x head). Backward: one program per (64 keys, batch x kv head), looping over the group's
query heads and query tiles (``delta = rowsum(dO * O)`` computed once beforehand, as in FlashAttention-2): dK and
dV accumulate in registers, dQ through FP32 atomic adds (whose order, and so
whose last bits, vary from run to run). When PyTorch is asked for deterministic algorithms, each program stores
its dQ contribution in its own slice of a ``[T / BN, B, H, T, D]`` buffer instead, summed over the key tiles
afterwards: the same bits on every run, for ``T / BN`` times dQ's memory while the backward runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .mx_quantize import _e2m1_codes
from .mx_values import _e2m1_value
from .nvfp4_quantize import _nvfp4_blocks

BM = 64  # queries per tile = the reference's dS TILE
BN = 64  # keys per tile
#: Triton's CPU interpreter multiplies BF16 dot operands wrongly; there the kernels multiply the same values as
#: FP32 with IEEE products (exact either way: BF16 values, FP32 accumulation)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mm(a, b, F32: tl.constexpr):
    """``a @ b`` with FP32 accumulation of BF16 operands (as FP32 under the interpreter)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, scale, T, H, G,
                D: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    q_base = q_ptr + bh.to(tl.int64) * T * D
    k_base = k_ptr + (b * (H // G) + hk).to(tl.int64) * T * D
    v_base = v_ptr + (b * (H // G) + hk).to(tl.int64) * T * D
    rm = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    q = tl.load(q_base + rm[:, None] * D + rd[None, :], mask=(rm < T)[:, None], other=0.0)
    qk_scale = scale / (tl.load(dq_ptr) * tl.load(dk_ptr))
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = tl.minimum((pid_m + 1) * BM, T) if CAUSAL else T
    for start in range(0, hi, BN):
        rn = start + tl.arange(0, BN)
        kmask = rn < T
        k = tl.load(k_base + rn[:, None] * D + rd[None, :], mask=kmask[:, None], other=0.0)
        s = _mm(q, tl.trans(k), F32) * qk_scale
        valid = kmask[None, :]
        if CAUSAL:
            valid = valid & (rn[None, :] <= rm[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rn[:, None] * D + rd[None, :], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(tl.bfloat16), v, F32)
        m_i = m_new
    # O = (P / l) V^ / d_v with P normalized after the sum: the reference's P is exp(s - lse), rounded to BF16
    o = acc / l_i[:, None] / tl.load(dv_ptr)
    tl.store(o_ptr + bh.to(tl.int64) * T * D + rm[:, None] * D + rd[None, :], o.to(tl.bfloat16), mask=(rm < T)[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * T + rm, m_i + tl.log(l_i), mask=rm < T)


@triton.jit
def _nvfp4_tile(ds, BM: tl.constexpr, BN: tl.constexpr):
    """NVFP4 of a [BM, BN] FP32 tile: 1x16 blocks along the rows' length, one FP32 scale for the tile.
    Returns (exact values ``q * sb``, the tile's ``s_enc``)."""
    amax = tl.max(tl.max(tl.abs(ds), axis=1), axis=0)
    s_enc = tl.minimum(tl.math.div_rn(2688.0, amax), 3.4028234663852886e38)
    s_enc = tl.where(amax == 0.0, 1.0, s_enc)
    v, _, sb, _ = _nvfp4_blocks(tl.reshape(ds, [BM * BN // 16, 16]), s_enc, False)
    val = _e2m1_value(_e2m1_codes(v, v, False)) * sb[:, None]
    return tl.reshape(val, [BM, BN]), s_enc


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, delta_ptr, do_ptr, lse_ptr, dqacc_ptr, dk_ptr, dv_ptr, dq_div_ptr, dk_div_ptr, dv_div_ptr,
                scale, T, H, G, D: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr,
                DET: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)  # batch x kv head
    hkv = H // G
    b = bhk // hkv
    hk = bhk % hkv
    rn = pid_n * BN + tl.arange(0, BN)
    rd = tl.arange(0, D)
    kmask = rn < T
    kv_off = bhk.to(tl.int64) * T * D
    k = tl.load(k_ptr + kv_off + rn[:, None] * D + rd[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off + rn[:, None] * D + rd[None, :], mask=kmask[:, None], other=0.0)
    div_q = tl.load(dq_div_ptr)
    div_k = tl.load(dk_div_ptr)
    div_v = tl.load(dv_div_ptr)
    qk_scale = scale / (div_q * div_k)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lo = (pid_n * BN // BM) * BM if CAUSAL else 0
    for g in range(0, G):
        bh = b * H + hk * G + g
        q_base = bh.to(tl.int64) * T * D
        for start in range(lo, T, BM):
            rm = start + tl.arange(0, BM)
            qmask = rm < T
            q = tl.load(q_ptr + q_base + rm[:, None] * D + rd[None, :], mask=qmask[:, None], other=0.0)
            do = tl.load(do_ptr + q_base + rm[:, None] * D + rd[None, :], mask=qmask[:, None], other=0.0)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * T + rm, mask=qmask, other=0.0)
            delta = tl.load(delta_ptr + bh.to(tl.int64) * T + rm, mask=qmask, other=0.0)
            s = _mm(q, tl.trans(k), F32) * qk_scale
            valid = qmask[:, None] & kmask[None, :]
            if CAUSAL:
                valid = valid & (rn[None, :] <= rm[:, None])
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dv += _mm(tl.trans(p.to(tl.bfloat16)), do, F32)
            dp = _mm(do, tl.trans(v), F32) / div_v
            ds = p * (dp - delta[:, None])
            dsv, s_enc = _nvfp4_tile(ds, BM, BN)
            dsv16 = dsv.to(tl.bfloat16)  # exact: E2M1 x E4M3
            dk += _mm(tl.trans(dsv16), q, F32) / s_enc
            dq = _mm(dsv16, k, F32) * (scale / (div_k * s_enc))
            if DET:  # this key tile's own slice: no two programs write one address
                part = pid_n.to(tl.int64) * tl.num_programs(1) * G * T * D
                tl.store(dqacc_ptr + part + q_base + rm[:, None] * D + rd[None, :], dq, mask=qmask[:, None])
            else:
                tl.atomic_add(dqacc_ptr + q_base + rm[:, None] * D + rd[None, :], dq, mask=qmask[:, None])
    tl.store(dk_ptr + kv_off + rn[:, None] * D + rd[None, :], dk * (scale / div_q), mask=kmask[:, None])
    tl.store(dv_ptr + kv_off + rn[:, None] * D + rd[None, :], dv, mask=kmask[:, None])


def forward(qv, kv, vv, dq, dk, dv, *, causal: bool, scale: float):
    """Triton twin of :func:`fp4train.attention.reference.forward`."""
    B, H, T, D = qv.shape
    G = H // kv.shape[1]
    o = torch.empty_like(qv, dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=qv.device)
    _fwd_kernel[(triton.cdiv(T, BM), B * H)](qv, kv, vv, o, lse, dq.reshape(1), dk.reshape(1), dv.reshape(1), scale, T, H, G,
                                            D=D, CAUSAL=causal, BM=BM, BN=BN, F32=INTERPRETED)
    return o, lse


def backward(do, o, lse, qv, kv, vv, dq, dk, dv, *, causal: bool, scale: float):
    """Triton twin of :func:`fp4train.attention.reference.backward`: (dQ, dK, dV) in FP32."""
    B, H, T, D = qv.shape
    hkv = kv.shape[1]
    det = torch.are_deterministic_algorithms_enabled()
    do = do.to(torch.bfloat16).contiguous()
    # delta = rowsum(dO * O) once for every query row, as the reference computes it (not once per key tile)
    delta = (do.float() * o.float()).sum(-1).contiguous()
    tiles = triton.cdiv(T, BN)
    d_q = torch.zeros(*((tiles,) if det else ()), B, H, T, D, dtype=torch.float32, device=qv.device)
    d_k = torch.empty(B, hkv, T, D, dtype=torch.float32, device=qv.device)
    d_v = torch.empty_like(d_k)
    _bwd_kernel[(tiles, B * hkv)](qv, kv, vv, delta, do, lse, d_q, d_k, d_v,
                                               dq.reshape(1), dk.reshape(1), dv.reshape(1), scale, T, H, H // hkv,
                                               D=D, CAUSAL=causal, BM=BM, BN=BN, F32=INTERPRETED, DET=det)
    return (d_q.sum(0) if det else d_q), d_k, d_v
