"""Block Walsh-Hadamard transform in Triton: one read and one write per element.

Bit-identical to the reference ``fp4train.hadamard(x, block, axis, seed)`` (FP32 work):
optional sign multiplication ``x * d``, then the same ``log2(b)`` butterfly stages in the same
order - stage ``h`` pairs element ``i`` with ``i + h`` inside every ``2h`` group and writes
``(u + v, u - v)`` - then one multiplication by ``fp32(1/sqrt(b))`` and the cast back to the
input dtype (round to nearest even). The butterflies run in registers on a ``[ROWS, b]`` tile:
a stage reshapes the tile to ``[ROWS, b/2h, 2, h]``, moves the pair axis last and splits it.

Works along either axis of a 2D tensor through strides (axis 0 transforms columns).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _butterfly(y, ROWS: tl.constexpr, B: tl.constexpr, H: tl.constexpr):
    t = tl.permute(tl.reshape(y, [ROWS, B // (2 * H), 2, H]), [0, 1, 3, 2])  # [ROWS, B/2H, H, 2]
    u, v = tl.split(t)
    t = tl.join(u + v, u - v)  # [ROWS, B/2H, H, 2]
    return tl.reshape(tl.permute(t, [0, 1, 3, 2]), [ROWS, B])


@triton.jit
def _butterfly_sums(y, ROWS: tl.constexpr, B: tl.constexpr, H: tl.constexpr):
    """:func:`_butterfly` by sums over the pair axis instead of moving it last: in ``[ROWS, B/2H, 2, H]`` the pair
    (u, v) lies along axis 2, and ``u + v`` and ``u * 1 + v * -1`` (= ``u - v`` exactly: both products are exact,
    and IEEE defines ``u - v`` as ``u + (-v)``) are reductions over it, put back in the pair's two places. The fused
    fold (kernels/mx_fold.py) takes it on request (``butterfly="sums"``): its sm90 build needs fewer instructions,
    registers and shared-memory operations and it ran 1.5-1.6x faster on a 16384 x 8192 BF16
    tensor along dim 1 on the H200, but 4-16x slower along dim 0 (x read down its columns). Timed on AdaHOP's own
    calls, sums lead with 1x128 groups on contiguous reads and permutes everywhere
    else; ``FOLD_LAUNCH_HADAMARD`` in mx_fold.py says which. The standalone kernel below
    keeps :func:`_butterfly`, which compiles to fewer instructions there."""
    t = tl.reshape(y, [ROWS, B // (2 * H), 2, H])
    first = (tl.arange(0, 2) == 0)[None, None, :, None]
    s = tl.sum(t, axis=2)[:, :, None, :]
    d = tl.sum(t * tl.where(first, 1.0, -1.0), axis=2)[:, :, None, :]
    return tl.reshape(tl.where(first, s, d), [ROWS, B])


@triton.jit
def transform_rows(y, d_ptr, HAS_D: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
                   NORM: tl.constexpr):
    """The reference's transform of each row of a float32 ``[ROWS, B]`` tile: signs ``d`` (if any), the
    butterflies, the FP32 normalization (before the cast back to the input dtype)."""
    if HAS_D:
        y = y * tl.load(d_ptr + tl.arange(0, B))[None, :]
    for s in tl.static_range(LOG_B):
        y = _butterfly(y, ROWS, B, 1 << s)
    return y * NORM


@triton.jit
def bf16_bits(y):
    """Float32 ``y`` rounded to BF16 (nearest even, in integers: the interpreter's float cast truncates), as
    the 16 bits; NaN stays NaN."""
    bits = y.to(tl.uint32, bitcast=True)
    rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits >> 16) | 0x40, rne)


@triton.jit
def transform_cols(x, d_ptr, HAS_D: tl.constexpr, B: tl.constexpr, BK: tl.constexpr, LOG_B: tl.constexpr,
                   NORM: tl.constexpr, ROUND_BF16: tl.constexpr):
    """A ``[B, BK]`` tile transformed down its columns (one block each) as the reference does it along dim 0 -
    rounded to BF16 where the input is BF16 - returned transposed, ``[BK, B]`` float32: one block per row, the
    layout the column quantization kernels work in."""
    y = transform_rows(tl.trans(x.to(tl.float32)), d_ptr, HAS_D, BK, B, LOG_B, NORM)
    if ROUND_BF16:
        y = (bf16_bits(y) << 16).to(tl.float32, bitcast=True)
    return y


@triton.jit
def cols_as_rows(x, d_ptr, H: tl.constexpr, HAS_D: tl.constexpr, B: tl.constexpr, BK: tl.constexpr, LOG_B: tl.constexpr,
                 NORM: tl.constexpr, ROUND_BF16: tl.constexpr):
    """A ``[B, BK]`` tile as ``[BK, B]`` float32 (one column a row, the column quantization kernels' layout),
    transformed down its columns first where ``H`` (:func:`transform_cols`)."""
    if H:
        return transform_cols(x, d_ptr, HAS_D, B, BK, LOG_B, NORM, ROUND_BF16)
    return tl.trans(x.to(tl.float32))


@triton.jit
def _hadamard_kernel(
    x_ptr, d_ptr, y_ptr, n_rows, n_cols, sx_r, sx_c, sy_r, sy_c,
    HAS_D: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """Program (i, j): rows i*ROWS.., columns j*B..(j+1)*B (one transform block per row)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * B + tl.arange(0, B)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx_r + c[None, :] * sx_c, mask=mask, other=0.0)
    y = transform_rows(x.to(tl.float32), d_ptr, HAS_D, ROWS, B, LOG_B, NORM)
    out = bf16_bits(y).to(tl.uint16) if OUT_BF16 else y
    tl.store(y_ptr + r[:, None] * sy_r + c[None, :] * sy_c, out, mask=mask)


@functools.lru_cache(maxsize=None)
def norm(block: int) -> float:
    """The reference's FP32 normalization constant ``1/sqrt(block)``."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def block_hadamard(x: torch.Tensor, d: torch.Tensor | None, *, block: int, axis: int, rows_per_program: int | None = None) -> torch.Tensor:
    """``fp4train.hadamard`` of a 2D float32/bfloat16/float16 tensor along ``axis`` with sign
    vector ``d`` (float32 ``[block]`` or None); same dtype and layout as ``x``."""
    if x.ndim != 2 or axis not in (0, 1, -1, -2):
        raise ValueError(f"block_hadamard takes a 2D tensor and axis 0 or 1, got shape {tuple(x.shape)}, axis {axis}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"block_hadamard takes float32/bfloat16/float16, got {x.dtype}")
    if block < 2 or block & (block - 1) or x.shape[axis] % block:
        raise ValueError(f"block_hadamard: block {block} must be a power of two dividing dim {axis} ({x.shape[axis]})")
    out_bf16 = x.dtype == torch.bfloat16
    y = torch.empty_like(x, dtype=torch.float32 if x.dtype == torch.float16 else x.dtype)
    y_store = y.view(torch.uint16) if out_bf16 else y
    # view the transformed axis as the columns: (rows, cols) with their strides
    if axis % 2 == 1:
        n_rows, n_cols, sx, sy = x.shape[0], x.shape[1], x.stride(), y.stride()
    else:
        n_rows, n_cols, sx, sy = x.shape[1], x.shape[0], x.stride()[::-1], y.stride()[::-1]
    if d is not None:
        d = d.to(device=x.device, dtype=torch.float32).contiguous()
    rows_per_program = rows_per_program or (128 if block <= 16 else 32)
    grid = (triton.cdiv(n_rows, rows_per_program), n_cols // block)
    if n_rows and n_cols:
        _hadamard_kernel[grid](x, d if d is not None else x, y_store, n_rows, n_cols, sx[0], sx[1], sy[0], sy[1],
                               HAS_D=d is not None, B=block, LOG_B=int(math.log2(block)), ROWS=rows_per_program, NORM=norm(block),
                               OUT_BF16=out_bf16)
    return y.to(x.dtype)
