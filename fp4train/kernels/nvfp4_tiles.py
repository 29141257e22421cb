"""NVFP4 with 16x16 tiles (the weights of NVIDIA's NVFP4 recipe) in Triton: codes, or the BF16 values.

``quantize(x, "nvfp4", block=(16, 16), ...)`` of a 2D tensor, bit for bit: one FP32 tensor scale
``s_enc`` from the finite amax (:func:`.nvfp4_quantize.device_tensor_scale`, left on the device), then per
16x16 tile - 256 elements sharing one E4M3 scale - the 1x16 kernels' float order
(:func:`.nvfp4_quantize._nvfp4_scale` / ``_nvfp4_scaled``)::

    sb = e4m3((amax_tile / 6) * s_enc)      q = e2m1((x * s_enc) / sb)

A program takes 16 rows and ``NB`` tiles side by side, as two ``[16, NB, 8]`` tensors (the even and
the odd columns: the low and high nibbles of the packed bytes), and reduces each tile over axes 2 and
0. The stochastic-rounding index is the reference's blocked order (``BlockLayout.blockify``): tile
``(tr, tc)`` is block ``tr * n_tc + tc``, element ``(i, j)`` of it is ``i * 16 + j``. Shapes that are not
whole tiles are zero padded like the reference.

:func:`quantize_nvfp4_2d` writes packed codes and tile scales (a :class:`QuantizedTensor`);
:func:`nvfp4_tile_values` decodes them (:func:`.scaled_decode.decode_scaled_bf16`) into the values
``q * sb`` as exact BF16 for a GEMM on BF16 tensor cores, with ``s_enc`` as the divisor
(``quantize(...).scaled_bf16()``).

History, a Triton miscompile: the first version regrouped the program's ``[16, NB*16]`` block into
``[NB, 256]`` (``reshape`` + ``permute``, one tile per row) and reduced along rows, and had a second
output mode for the values (``q * sb[:, None]``). Right in Triton's CPU interpreter, wrong on the H200
(Triton 3.6): values took a neighbouring tile's scale (`bench/results/gpu-tests/gpu_tests-262876e.log`,
`bench/results/probes/nvfp4_tile_values-H200-0e1397a.log`), and once the values came from the decode
kernel instead, the codes of BF16 input showed tile amaxes that missed elements
(`bench/results/gpu-tests/kernels-subset-497c27d.log`). The tile view is now built from loads alone.
The extra decode pass (0.56 byte/element read) is for a weight, prepared once a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from .mx_quantize import _e2m1_codes, _kernel_keys, _keys, _uniforms
from .nvfp4_quantize import _four_six_candidates, _nvfp4_scale, _nvfp4_scaled, _squared_errors, device_tensor_scale, four_six
from .scaled_decode import decode_scaled_bf16

TILES_PER_PROGRAM = 8  # 16 x 128 elements per program


@triton.jit(do_not_specialize=["key", "key2"])
def _nvfp4_tile_kernel(x_ptr, s_enc_ptr, codes_ptr, scales_ptr, R, C, n_tc, sx, sc, ss, key, key2,
                       SR: tl.constexpr, NB: tl.constexpr, KEYS_PTR: tl.constexpr = False, FOUR_SIX: tl.constexpr = False):
    """Rows ``program_id(0) * 16 ..`` x tiles ``program_id(1) * NB ..``: codes (two per byte along the
    rows, element 2j in the low nibble) + E4M3 tile scales into the padded canonical layout.

    The tiles are held as ``[16 rows, NB tiles, 8]`` twice - the even and the odd columns, the low and
    high nibbles of the bytes - and reduced over axes 2 and 0, with no reshape or permute (the first
    version regrouped ``[16, NB*16]`` into ``[NB, 256]``; its per-tile reductions came out wrong on the
    H200 while right in the interpreter, see the module docstring)."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    s_enc = tl.load(s_enc_ptr)
    tr = tl.program_id(0)
    tc = tl.program_id(1) * NB + tl.arange(0, NB)  # [NB] tile columns
    i = tl.arange(0, 16)[:, None, None]  # row within the tile
    k = tl.arange(0, 8)[None, None, :]  # byte within the tile's row
    t3 = tc[None, :, None]
    r = tr * 16 + i
    c_even = t3 * 16 + 2 * k
    ptr = x_ptr + r * sx + c_even
    xe = tl.load(ptr, mask=(r < R) & (c_even < C), other=0.0).to(tl.float32)  # [16, NB, 8]
    xo = tl.load(ptr + 1, mask=(r < R) & (c_even + 1 < C), other=0.0).to(tl.float32)
    fe, fo = tl.abs(xe) < float("inf"), tl.abs(xo) < float("inf")
    nan_tile = tl.max(tl.max(tl.where(fe & fo, 0, 1), axis=2), axis=0) > 0  # [NB]
    xe, xo = tl.where(fe, xe, 0.0), tl.where(fo, xo, 0.0)
    amax = tl.max(tl.max(tl.maximum(tl.abs(xe), tl.abs(xo)), axis=2), axis=0)
    sb_code, sb = _nvfp4_scale(amax, s_enc, SR, 6.0)
    if FOUR_SIX:  # 4/6 as the 1x16 kernels choose it (nvfp4_quantize._four_over_six), the errors summed over the tile
        code4, sb4, near4, near6 = _four_six_candidates(amax, s_enc, sb, SR)
        n4, n6 = near4[None, :, None], near6[None, :, None]
        err4 = _tile_sum(_squared_errors(xe, s_enc, n4), _squared_errors(xo, s_enc, n4), NB)
        err6 = _tile_sum(_squared_errors(xe, s_enc, n6), _squared_errors(xo, s_enc, n6), NB)
        use4 = err4 < err6
        sb_code, sb = tl.where(use4, code4, sb_code), tl.where(use4, sb4, sb)
    sb3 = sb[None, :, None]
    ve, vo = _nvfp4_scaled(xe, s_enc, sb3), _nvfp4_scaled(xo, s_enc, sb3)
    ue, uo = ve, vo
    if SR:  # the reference's blocked index: tile (tr, tc) is block tr * n_tc + tc, element (i, j) is i * 16 + j
        idx = (tr * n_tc + t3) * 256 + i * 16 + 2 * k
        ue, uo = _uniforms(idx, key, key2), _uniforms(idx + 1, key, key2)
    keep = nan_tile[None, :, None] == 0
    lo = tl.where(keep, _e2m1_codes(ve, ue, SR), 0)
    hi = tl.where(keep, _e2m1_codes(vo, uo, SR), 0)
    tl.store(codes_ptr + r * sc + t3 * 8 + k, (lo | (hi << 4)).to(tl.uint8), mask=t3 < n_tc)
    tl.store(scales_ptr + tr * ss + tc, tl.where(nan_tile, 0x7F, sb_code).to(tl.uint8), mask=tc < n_tc)


@triton.jit
def _tile_sum(even, odd, NB: tl.constexpr):
    """Per tile, the sum of its 256 elements held as ``[16 rows, NB tiles, 8]`` even and odd columns, in
    :func:`fp4train.formats.nvfp4.pairwise_sum`'s tree over the tile's flat index ``i * 16 + j``: along each row,
    then down the row sums (each level a sum over an axis of two)."""
    t = even + odd
    t = tl.sum(tl.reshape(t, [16, NB, 4, 2]), axis=3)
    t = tl.sum(tl.reshape(t, [16, NB, 2, 2]), axis=3)
    t = tl.sum(t, axis=2)
    t = tl.sum(tl.reshape(t, [8, 2, NB]), axis=1)
    t = tl.sum(tl.reshape(t, [4, 2, NB]), axis=1)
    t = tl.sum(tl.reshape(t, [2, 2, NB]), axis=1)
    return tl.sum(t, axis=0)


def _check(name: str, x: torch.Tensor, rounding: str) -> torch.Tensor:
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} takes a 2D float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{name}: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    return x.contiguous()


def _launch(x, s_enc, codes, scales, rows, n_tc, rounding, seed, four_over_six) -> None:
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    if rows and n_tc:
        nb = TILES_PER_PROGRAM
        _nvfp4_tile_kernel[(triton.cdiv(rows, 16), triton.cdiv(n_tc, nb))](
            x, s_enc, codes, scales, x.shape[0], x.shape[1], n_tc, x.stride(0), codes.stride(0), scales.stride(0),
            key, key2, SR=sr, NB=nb, KEYS_PTR=kp, **four_six(four_over_six))


def quantize_nvfp4_2d(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None,
                      four_over_six: bool = False) -> QuantizedTensor:
    """NVFP4 with 16x16 tiles of a 2D tensor, any shape; see the module docstring. ``four_over_six``: 4/6 scaling
    per tile (:func:`fp4train.formats.nvfp4.encode_blocks`)."""
    x = _check("quantize_nvfp4_2d", x, rounding)
    layout = BlockLayout(tuple(x.shape), (16, 16), None)
    rp, cp = layout.canonical_shape
    s_enc = device_tensor_scale(x, four_over_six=four_over_six)
    codes = torch.empty(rp, cp // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rp // 16, cp // 16, dtype=torch.uint8, device=x.device)
    _launch(x, s_enc, codes, scales, rp, cp // 16, rounding, seed, four_over_six)
    return QuantizedTensor("nvfp4", codes, scales, s_enc.reshape(()), layout, x.dtype)


def nvfp4_tile_values(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None,
                      four_over_six: bool = False) -> ScaledBF16:
    """``quantize(x, "nvfp4", block=(16, 16), ...).scaled_bf16()`` of a 2D tensor, any shape: the
    dequantized values in BF16 (exact) and ``s_enc`` as the divisor; see the module docstring."""
    values = decode_scaled_bf16(quantize_nvfp4_2d(x, rounding=rounding, seed=seed, four_over_six=four_over_six))
    if values is None:  # the decode kernel covers every NVFP4 16x16 layout this function makes
        raise AssertionError("decode_scaled_bf16 declined an NVFP4 16x16 tensor")
    return values
