"""NVFP4 with 16x16 tiles (the weights of NVIDIA's NVFP4 recipe) in Triton: codes, or the BF16 values.

``quantize(x, "nvfp4", block=(16, 16), ...)`` of a 2D tensor, bit for bit: one FP32 tensor scale
``s_enc`` from the finite amax (:func:`.amax.finite_amax`, one pass, left on the device), then per
16x16 tile - 256 elements sharing one E4M3 scale - the 1x16 kernels' float order
(:func:`.nvfp4_quantize._nvfp4_blocks`)::

    sb = e4m3((amax_tile / 6) * s_enc)      q = e2m1((x * s_enc) / sb)

A program takes 16 rows and ``NB`` tiles side by side, and regroups them as ``[NB, 256]`` - one
tile per row, its elements row-major - which is the reference's blocked order (``BlockLayout.blockify``)
and so also the stochastic-rounding index: tile ``(tr, tc)`` is block ``tr * n_tc + tc``, element
``(i, j)`` of it is ``i * 16 + j``. Shapes that are not whole tiles are zero padded like the reference.

:func:`quantize_nvfp4_2d` writes packed codes and tile scales (a :class:`QuantizedTensor`);
:func:`nvfp4_tile_values` decodes them (:func:`.scaled_decode.decode_scaled_bf16`) into the values
``q * sb`` as exact BF16 for a GEMM on BF16 tensor cores, with ``s_enc`` as the divisor
(``quantize(...).scaled_bf16()``).

The values once came from this kernel directly (a second output mode, ``q * sb[:, None]`` in the
``[NB, 256]`` tile-per-row view). Right in Triton's CPU interpreter, wrong on the H200 (Triton 3.6):
tiles took a neighbouring tile's scale - tile (0, 0) of a random tensor came out with tile (0, 1)'s
scale, and a tensor of one tile (the other seven of the program padding) with a padding tile's zero -
while the codes and scales of the same program were right (`bench/results/gpu-tests/gpu_tests-262876e.log`,
`scripts/probes/nvfp4_tile_values.py`). Quantize-then-decode costs one extra pass over the packed codes
(0.56 byte/element) for a tensor that is a weight, prepared once a step; both kernels are bit-exact
on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from .mx_quantize import _e2m1_codes, _keys, _uniforms
from .nvfp4_quantize import _nvfp4_blocks, device_tensor_scale

TILES_PER_PROGRAM = 8  # 16 x 128 elements per program


@triton.jit
def _to_tiles(x, NB: tl.constexpr):
    """[16, NB*16] -> [NB, 256]: tile t's 16x16 elements, row-major, in row t."""
    return tl.reshape(tl.permute(tl.reshape(x, [16, NB, 16]), (1, 0, 2)), [NB, 256])


@triton.jit
def _from_tiles(t, NB: tl.constexpr):
    """The inverse of :func:`_to_tiles`."""
    return tl.reshape(tl.permute(tl.reshape(t, [NB, 16, 16]), (1, 0, 2)), [16, NB * 16])


@triton.jit(do_not_specialize=["key", "key2"])
def _nvfp4_tile_kernel(x_ptr, s_enc_ptr, codes_ptr, scales_ptr, R, C, n_tc, sx, sc, ss, key, key2,
                       SR: tl.constexpr, NB: tl.constexpr):
    """Rows ``program_id(0) * 16 ..`` x tiles ``program_id(1) * NB ..``: codes (two per byte along the
    rows, element 2j in the low nibble) + E4M3 tile scales into the padded canonical layout."""
    tr = tl.program_id(0)
    tc = tl.program_id(1) * NB + tl.arange(0, NB)
    r = tr * 16 + tl.arange(0, 16)
    c = tl.program_id(1) * (NB * 16) + tl.arange(0, NB * 16)
    inside = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=inside, other=0.0).to(tl.float32)
    v, sb_code, sb, nan_tile = _nvfp4_blocks(_to_tiles(x, NB), tl.load(s_enc_ptr))  # [NB, 256]
    u = v
    if SR:
        u = _uniforms((tr * n_tc + tc)[:, None] * 256 + tl.arange(0, 256)[None, :], key, key2)
    code = _from_tiles(tl.where(nan_tile[:, None], 0, _e2m1_codes(v, u, SR)), NB)  # [16, NB*16]
    lo, hi = tl.split(tl.reshape(code, [16, NB * 8, 2]))
    pc = tl.program_id(1) * (NB * 8) + tl.arange(0, NB * 8)
    tl.store(codes_ptr + r[:, None] * sc + pc[None, :], (lo | (hi << 4)).to(tl.uint8), mask=(pc < n_tc * 8)[None, :])
    tl.store(scales_ptr + tr * ss + tc, tl.where(nan_tile, 0x7F, sb_code).to(tl.uint8), mask=tc < n_tc)


def _check(name: str, x: torch.Tensor, rounding: str) -> torch.Tensor:
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} takes a 2D float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{name}: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    return x.contiguous()


def _launch(x, s_enc, codes, scales, rows, n_tc, rounding, seed) -> None:
    sr, key, key2 = _keys(rounding, seed)
    if rows and n_tc:
        nb = TILES_PER_PROGRAM
        _nvfp4_tile_kernel[(triton.cdiv(rows, 16), triton.cdiv(n_tc, nb))](
            x, s_enc, codes, scales, x.shape[0], x.shape[1], n_tc, x.stride(0), codes.stride(0), scales.stride(0),
            key, key2, SR=sr, NB=nb)


def quantize_nvfp4_2d(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None) -> QuantizedTensor:
    """NVFP4 with 16x16 tiles of a 2D tensor, any shape; see the module docstring."""
    x = _check("quantize_nvfp4_2d", x, rounding)
    layout = BlockLayout(tuple(x.shape), (16, 16), None)
    rp, cp = layout.canonical_shape
    s_enc = device_tensor_scale(x)
    codes = torch.empty(rp, cp // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rp // 16, cp // 16, dtype=torch.uint8, device=x.device)
    _launch(x, s_enc, codes, scales, rp, cp // 16, rounding, seed)
    return QuantizedTensor("nvfp4", codes, scales, s_enc.reshape(()), layout, x.dtype)


def nvfp4_tile_values(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None) -> ScaledBF16:
    """``quantize(x, "nvfp4", block=(16, 16), ...).scaled_bf16()`` of a 2D tensor, any shape: the
    dequantized values in BF16 (exact) and ``s_enc`` as the divisor; see the module docstring."""
    from .scaled_decode import decode_scaled_bf16

    values = decode_scaled_bf16(quantize_nvfp4_2d(x, rounding=rounding, seed=seed))
    if values is None:  # the decode kernel covers every NVFP4 16x16 layout this function makes
        raise AssertionError("decode_scaled_bf16 declined an NVFP4 16x16 tensor")
    return values
