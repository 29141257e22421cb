"""Triton kernels against the reference numerics, bit for bit.

On a machine without a GPU the kernels run in Triton's interpreter (small shapes); on a GPU
they compile. Skipped where Triton is not installed.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fp4train  # noqa: E402
from fp4train.kernels import quantize_mxfp4  # noqa: E402
from fp4train.kernels.e4m3 import e4m3_rtne  # noqa: E402
from fp4train.kernels.nvfp4_quantize import _pairwise_sum16  # noqa: E402
from fp4train.kernels.nvfp4_tiles import _tile_sum  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _special(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows)[:, None]
    if rows > 3 and cols >= 64:
        x[0, 5] = float("nan")
        x[1, 33] = float("inf")
        x[2, :32] = 0.0
        x[3, 3] = -0.0
        x[3, 40:44] = torch.tensor([1e-40, -3e-39, 3.3e38, -2e38])  # subnormal and huge
    return x


@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (5, 160)])
@pytest.mark.parametrize("scale", ["floor", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp4_kernel_equals_reference(shape, scale, rounding):
    x = _special(*shape, seed=shape[0])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for seed in (0, 2**40 + 5):
            ref = fp4train.quantize(xd, "mxfp4", scale=scale, rounding=rounding, seed=seed)
            # 4 or 8 blocks a program: a partial last program; launch tuning
            # the even/odd-element kernel too (pairs; BF16 read as 32-bit words), a partial program included
            launches = ((1, None, False), (4, None, False), (8, 8, False), (4, None, True)) if dtype == torch.float32 else \
                ((None, None, False), (None, None, True), (2, 4, True))
            for bpp, nw, pairs in launches:  # None: MX1D_LAUNCH
                got = quantize_mxfp4(xd.to(DEV), scale=scale, rounding=rounding, seed=seed, blocks_per_program=bpp, num_warps=nw,
                                     pairs=pairs)
                assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales), (bpp, pairs)
                torch.testing.assert_close(got.dequantize().cpu(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
            if rounding == "nearest":
                break  # the seed does not matter


def test_mxfp4_kernel_rejects_bad_input():
    with pytest.raises(ValueError, match="last dim is a multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48, device=DEV))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("shape", [(32, 32), (64, 160)])
@pytest.mark.parametrize("scale", [("floor", "ceil"), ("ceil", "floor")])
@pytest.mark.parametrize("rounding", [("nearest", "stochastic"), ("stochastic", "nearest")])
def test_mxfp4_dual_kernel_equals_both_reference_layouts(shape, scale, rounding):
    from fp4train.kernels import quantize_mxfp4_dual

    x = _special(*shape, seed=7)
    seeds = (5, 2**40 + 1)
    rows, cols = quantize_mxfp4_dual(x.to(DEV), scale=scale, rounding=rounding, seed=seeds)
    ref_r = fp4train.quantize(x, "mxfp4", axis=-1, scale=scale[0], rounding=rounding[0], seed=seeds[0])
    ref_c = fp4train.quantize(x, "mxfp4", axis=0, scale=scale[1], rounding=rounding[1], seed=seeds[1])
    for got, ref in ((rows, ref_r), (cols, ref_c)):
        assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        torch.testing.assert_close(got.dequantize().cpu(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
    assert cols.block_axis == 0 and cols.t().block_axis == 1  # ready as the wgrad operand X^T


def test_mxfp4_dual_kernel_rejects_bad_shapes():
    from fp4train.kernels import quantize_mxfp4_dual

    with pytest.raises(ValueError, match="both dims multiples of 32"):
        quantize_mxfp4_dual(torch.randn(40, 64, device=DEV))


@triton.jit
def _e4m3_kernel(x_ptr, code_ptr, val_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c, v = e4m3_rtne(tl.load(x_ptr + i, mask=m, other=0.0))
    tl.store(code_ptr + i, c, mask=m)
    tl.store(val_ptr + i, v, mask=m)


def _e4m3_roundtrip(x):
    codes = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    vals = torch.empty_like(x)
    _e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, codes, vals, x.numel(), BLOCK=1024)
    return codes, vals


def test_e4m3_integer_rounding_equals_the_reference_cast():
    from fp4train.formats import e4m3

    rep = e4m3.decode(torch.arange(0, 127, dtype=torch.uint8))
    mids = (rep[:-1] + rep[1:]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([rep, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, torch.full_like(mids, 500.0)),
                   torch.rand(4000, generator=g) * 448, torch.exp2(torch.rand(4000, generator=g) * 20 - 12).clamp(max=448)])
    codes, vals = _e4m3_roundtrip(x.contiguous().to(DEV))
    ref = e4m3.encode(x)
    assert torch.equal(codes.cpu().to(torch.uint8), ref) and torch.equal(vals.cpu(), e4m3.decode(ref))


def test_nvfp4_tensor_scale_on_the_device_is_the_references():
    """The kernels' tensor scale (an amax per row, then one launch for the scale) equals the reference's
    ``scale_from_amax(finite_amax(x))``: every row counts (more rows than one program's block), NaN/Inf are left
    out, an all-zero or empty tensor gets 1, and a subnormal amax saturates at the largest FP32."""
    from fp4train.formats import nvfp4
    from fp4train.kernels.nvfp4_quantize import device_tensor_scale

    g = torch.Generator().manual_seed(0)
    many = torch.randn(2100, 16, generator=g)
    many[1500, 3] = 40.0  # the largest, in the second block of rows
    cases = {"many rows": many, "special": _special(9, 160, seed=3), "zeros": torch.zeros(5, 32),
             "empty": torch.zeros(0, 16), "subnormal": torch.full((3, 16), 1e-40),
             "non-finite only": torch.tensor([[float("nan"), float("inf")] * 8])}
    for name, x in cases.items():
        want = nvfp4.tensor_scale(x).reshape(1)
        got = device_tensor_scale(x.to(DEV)).cpu()
        assert torch.equal(got, want), (name, got, want)


@pytest.mark.parametrize("shape", [(1, 16), (9, 160)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_kernel_equals_reference(shape, rounding, four_over_six):
    from fp4train.kernels import quantize_nvfp4

    x = _special(*shape, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = fp4train.quantize(xd, "nvfp4", rounding=rounding, seed=2**33 + 7, four_over_six=four_over_six)
        got = quantize_nvfp4(xd.to(DEV), rounding=rounding, seed=2**33 + 7, blocks_per_program=4, four_over_six=four_over_six)
        assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        assert torch.equal(got.tensor_scale.cpu(), ref.tensor_scale)
        torch.testing.assert_close(got.dequantize().cpu(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(2, 24, device=DEV))


@pytest.mark.parametrize("shape", [(64, 160), (33, 70), (16, 16)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_16x16_tile_kernels_equal_the_reference(shape, rounding, four_over_six):
    """NVFP4 with 16x16 tiles (the NVFP4 recipe's weights): codes + tile scales + tensor scale, and the
    BF16 values for a GEMM, each bit for bit the reference's - partial tiles (zero padded), a NaN and an
    Inf tile, an all-zero tile, a tile whose E4M3 scale underflows to zero, both input dtypes."""
    from fp4train.kernels.nvfp4_tiles import nvfp4_tile_values, quantize_nvfp4_2d

    g = torch.Generator().manual_seed(21)
    # four decades: within NVFP4's range (E4M3 tile scales span about five), so every tile has live codes
    x = torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None]
    if shape[0] >= 33:
        x[0, 5], x[17, 40] = float("nan"), float("-inf")  # a NaN and an Inf tile (left out of the tensor amax)
        x[:16, 16:32] = 0.0  # an all-zero tile
        x[16:32, 48:64] *= 1e-30  # tile (1, 3): its E4M3 scale underflows to zero
    seed = 2**34 + 5 if rounding == "stochastic" else None
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = fp4train.quantize(xd, "nvfp4", block=(16, 16), rounding=rounding, seed=seed, four_over_six=four_over_six)
        got = quantize_nvfp4_2d(xd.to(DEV), rounding=rounding, seed=seed, four_over_six=four_over_six)
        assert got.layout == ref.layout and torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        assert torch.equal(got.tensor_scale.cpu(), ref.tensor_scale)
        vref = ref.scaled_bf16()
        vals = nvfp4_tile_values(xd.to(DEV), rounding=rounding, seed=seed, four_over_six=four_over_six)
        assert vals.block_axis is None and vals.scale is None and torch.equal(vals.divisor.cpu(), vref.divisor)
        torch.testing.assert_close(vals.values.cpu(), vref.values, rtol=0, atol=0, equal_nan=True)
    if shape[0] >= 33:  # the NaN / Inf tiles and the flushed ones were there, and the rest is not flushed
        assert int(ref.scales[0, 0]) == int(ref.scales[1, 2]) == 0x7F and ref.scales[0, 1] == 0 and ref.scales[1, 3] == 0
        assert int((ref.scales != 0).sum()) == ref.scales.numel() - 2  # only those two tiles are zero
    with pytest.raises(ValueError, match="2D"):
        quantize_nvfp4_2d(torch.randn(4, device=DEV))


@pytest.mark.parametrize("fmt,seed", [("mxfp4", 11), ("mxfp8", 13)])
@pytest.mark.parametrize("shape", [(64, 96), (33, 129), (33, 70)])
@pytest.mark.parametrize("scale,rounding", [("floor", "nearest"), ("ceil", "stochastic")])
def test_mx_2d_tile_kernels_equal_reference(fmt, seed, shape, scale, rounding):
    from fp4train.kernels import quantize_mxfp4_2d, quantize_mxfp8_2d

    tiles = quantize_mxfp4_2d if fmt == "mxfp4" else quantize_mxfp8_2d
    x = _special(*shape, seed=seed)
    ref = fp4train.quantize(x, fmt, block=(32, 32), scale=scale, rounding=rounding, seed=2**35 + seed)
    got = tiles(x.to(DEV), scale=scale, rounding=rounding, seed=2**35 + seed)
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
    torch.testing.assert_close(got.t().dequantize().cpu(), ref.t().dequantize(), rtol=0, atol=0, equal_nan=True)
    if fmt == "mxfp4":  # launch tuning: several tiles per program, a partial last one
        for tc, nw in ((2, 2), (4, 8)):
            t = tiles(x.to(DEV), scale=scale, rounding=rounding, seed=2**35 + seed, tiles_per_program=tc, num_warps=nw)
            assert torch.equal(t.codes.cpu(), ref.codes) and torch.equal(t.scales.cpu(), ref.scales)
        # BF16 input: read as column pairs in 32-bit words where the row length is even and the data 4-byte
        # aligned (an odd length, or a view that starts on an odd element, takes the element-wise loads);
        # pairs=False: the general tile kernel - every way gives the reference's bits
        xb = x.bfloat16()
        refb = fp4train.quantize(xb, fmt, block=(32, 32), scale=scale, rounding=rounding, seed=2**35 + seed)
        odd_start = torch.empty(xb.numel() + 1, dtype=torch.bfloat16, device=DEV)[1:].view(xb.shape)
        odd_start.copy_(xb)
        assert odd_start.is_contiguous() and odd_start.data_ptr() % 4 == 2
        for xin, pairs in ((xb.to(DEV), True), (odd_start, True), (xb.to(DEV), False), (x.to(DEV), False)):
            t = tiles(xin, scale=scale, rounding=rounding, seed=2**35 + seed, pairs=pairs)
            want = refb if xin.dtype == torch.bfloat16 else ref
            assert torch.equal(t.codes.cpu(), want.codes) and torch.equal(t.scales.cpu(), want.scales), (xin.dtype, pairs)


@pytest.mark.parametrize("shape", [(1, 32), (7, 96)])
@pytest.mark.parametrize("scale", ["floor", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp8_kernel_equals_reference(shape, scale, rounding):
    from fp4train.kernels import quantize_mxfp8

    x = _special(*shape, seed=shape[0] + 3)
    if shape[0] > 5:  # values on E4M3 grid points, ties and the 448 boundary after scaling by 2**-e
        x[5, :8] = torch.tensor([448.0, 464.0, 480.0, 2**-9, 3 * 2**-10, 1.0625, -1.1875, 0.0])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for seed in (3, 2**40 + 7):
            ref = fp4train.quantize(xd, "mxfp8", scale=scale, rounding=rounding, seed=seed)
            got = quantize_mxfp8(xd.to(DEV), scale=scale, rounding=rounding, seed=seed, blocks_per_program=2)
            assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
            torch.testing.assert_close(got.dequantize().cpu(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
            if rounding == "nearest":
                break


def test_mxfp4_stochastic_rounding_on_the_grid_and_its_edges_equals_the_reference():
    """E2M1 stochastic rounding at every grid point, just below each, between, at and beyond the
    saturation at 6 (block scale 1: amax 7.5 pins e = 0, so the scaled values are these): the kernels
    give the reference's codes for every seed, and the mean of many roundings is the value itself."""
    from fp4train.kernels import quantize_mxfp4, quantize_mxfp4_2d

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    below = [torch.nextafter(torch.tensor(g), torch.tensor(0.0)).item() for g in grid[1:]]
    vals = torch.tensor(grid + below + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.999, 6.5, 7.0, 1e-30,
                                        0.1, 0.6, 1.1, 2.2, 4.4])
    assert vals.numel() == 31
    block = torch.cat([torch.tensor([7.5]), vals])
    x = torch.cat([block, -block]).repeat(1024, 1).reshape(-1, 32 * 32)  # [64, 1024]: 2048 blocks
    for seed in (1, 2**33 + 9):
        ref = fp4train.quantize(x, "mxfp4", rounding="stochastic", seed=seed)
        got = quantize_mxfp4(x.to(DEV), rounding="stochastic", seed=seed)
        assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        ref2 = fp4train.quantize(x, "mxfp4", block=(32, 32), rounding="stochastic", seed=seed)
        got2 = quantize_mxfp4_2d(x.to(DEV), rounding="stochastic", seed=seed)
        assert torch.equal(got2.codes.cpu(), ref2.codes) and torch.equal(got2.scales.cpu(), ref2.scales)
    mean = ref.dequantize().reshape(-1, 32)[:, 1:].reshape(-1, 2, 31).mean(dim=0)  # over blocks, per sign and value
    inside = vals <= 6.0
    torch.testing.assert_close(mean[0][inside], vals[inside], rtol=0.06, atol=0.02)
    torch.testing.assert_close(mean[1][inside], -vals[inside], rtol=0.06, atol=0.02)
    assert (mean[0][~inside] == 6.0).all()  # beyond the grid: saturates


def test_mxfp8_stochastic_rounding_is_unbiased_between_grid_neighbours():
    """Between E4M3 neighbours 1.0 and 1.125 (block scale 1: amax 256 pins e = 0), 1.03125 rounds
    up with probability 1/4; also at the subnormal gap (2**-9) and the top of the grid."""
    from fp4train.kernels import quantize_mxfp8

    n = 32 * 512
    x = torch.full((1, n), 1.03125)
    x[0, ::32] = 256.0
    x[0, 1::32] = 1.5 * 2**-9  # halfway between 2**-9 and 2 * 2**-9
    x[0, 2::32] = 440.0  # between 416 and 448: up with probability 24/32
    q = quantize_mxfp8(x.to(DEV), rounding="stochastic", seed=5).dequantize().cpu()[0]
    body = torch.ones(n, dtype=torch.bool)
    body[::32] = body[1::32] = body[2::32] = False
    assert set(q[body].unique().tolist()) == {1.0, 1.125}
    assert abs((q[body] == 1.125).float().mean().item() - 0.25) < 0.02
    assert abs(q[1::32].mean().item() / (1.5 * 2**-9) - 1) < 0.1
    assert abs((q[2::32] == 448.0).float().mean().item() - 0.75) < 0.1 and set(q[2::32].unique().tolist()) == {416.0, 448.0}


def test_mxfp8_kernels_reject_bad_input():
    from fp4train.kernels import quantize_mxfp8, quantize_mxfp8_2d

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="2D tensor"):
        quantize_mxfp8_2d(torch.randn(4, device=DEV))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_mxfp8(torch.ones(4, 32, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("block", [16, 32])
def test_block_hadamard_kernel_is_bit_identical(dtype, axis, seed, block):
    from fp4train.kernels.hadamard import block_hadamard
    from fp4train.transforms.hadamard import signs

    big = DEV == "cuda"
    x = _special(256 if big else 64, 512 if big else 96, 3).to(dtype).to(DEV)
    ref = fp4train.hadamard(x, block, axis=axis, seed=seed)
    d = signs(seed, block, device=DEV) if seed is not None else None
    out = block_hadamard(x, d, block=block, axis=axis, rows_per_program=16)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def test_block_hadamard_kernel_rejects_bad_requests():
    from fp4train.kernels.hadamard import block_hadamard

    with pytest.raises(ValueError, match="multiple|power of two"):
        block_hadamard(torch.randn(4, 48, device=DEV), None, block=32, axis=1)
    with pytest.raises(TypeError, match="float32"):
        block_hadamard(torch.zeros(4, 32, dtype=torch.int32, device=DEV), None, block=32, axis=1)


@pytest.mark.parametrize("axis", [1, 0, None])
@pytest.mark.parametrize("scale", ["floor", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_values_kernels_are_the_dequantized_reference(axis, scale, rounding, dtype, fmt):
    from fp4train import kernels

    values = getattr(kernels, f"{fmt}_values")

    big = DEV == "cuda"
    x = _special(512 if big else 64, 1024 if big else 96, 4).to(dtype).to(DEV)
    seed = 2**40 + 9 if rounding == "stochastic" else None
    block = (32, 32) if axis is None else 32
    q = fp4train.quantize(x, fmt, axis=-1 if axis is None else axis, block=block, scale=scale, rounding=rounding, seed=seed)
    got = values(x, axis=axis, scale=scale, rounding=rounding, seed=seed)
    assert got.values.dtype == torch.bfloat16 and got.block_axis == axis
    torch.testing.assert_close(got.values, q.dequantize(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    if axis is None:  # tiles of a tensor that is not whole tiles: zero padding, cropped
        odd = x[:50, :70]
        ref = fp4train.quantize(odd, fmt, block=(32, 32), scale=scale, rounding=rounding, seed=seed)
        torch.testing.assert_close(values(odd, axis=None, scale=scale, rounding=rounding, seed=seed).values,
                                   ref.dequantize(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_values_kernel_is_the_scaled_reference(axis, rounding, dtype, four_over_six):
    from fp4train.kernels import nvfp4_values

    big = DEV == "cuda"
    x = _special(512 if big else 64, 1024 if big else 96, 5).to(dtype).to(DEV)
    x[10:12] *= 1e-30  # blocks whose E4M3 scale underflows to zero
    seed = 77 if rounding == "stochastic" else None
    ref = fp4train.quantize(x, "nvfp4", axis=axis, rounding=rounding, seed=seed, four_over_six=four_over_six).scaled_bf16()
    got = nvfp4_values(x, axis=axis, rounding=rounding, seed=seed, four_over_six=four_over_six)
    assert got.block_axis == axis and got.scale is None
    torch.testing.assert_close(got.values, ref.values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.divisor, ref.divisor)


@pytest.mark.parametrize("axis", [2, 1])
def test_nvfp4_stacked_values_are_each_matrixs_own(axis):
    """A stack of matrices (Q-Root's same-shape updates) quantized in one launch a pass: each matrix's values and
    tensor scale bit for bit what it gets alone - its own scale, however far apart the matrices' magnitudes."""
    from fp4train.kernels import nvfp4_values
    from fp4train.kernels.nvfp4_values import nvfp4_stacked_values

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(4, 48, 80, generator=g) * torch.logspace(-3, 3, 4)[:, None, None]).to(DEV)
    x[2] = 0.0  # an all-zero matrix: scale 1
    values, scales = nvfp4_stacked_values(x, axis=axis)
    assert values.shape == x.shape and scales.shape == (4,)
    for i in range(4):
        alone = nvfp4_values(x[i], axis=axis - 1)
        assert torch.equal(values[i], alone.values) and torch.equal(scales[i], alone.divisor), i
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_stacked_values(x[:, :40], axis=axis)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("random_signs", [True, False])
@pytest.mark.parametrize("data", ["special", "gaussian"])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_with_fused_hadamard_is_the_reference_of_the_transformed_tensor(packed, rounding, dtype, random_signs, data,
                                                                              four_over_six):
    """NVIDIA's wgrad operands: NVFP4 along dim 0 of the 16-point (randomized) Hadamard transform, in one kernel -
    codes or values, tensor scale and the transform's rounding to the input dtype all the reference's."""
    from fp4train.kernels import nvfp4_values
    from fp4train.kernels.amax import hadamard_finite_amax
    from fp4train.kernels.nvfp4_quantize import quantize_nvfp4_columns
    from fp4train.transforms.hadamard import signs

    big = DEV == "cuda"
    shape = (512, 1024) if big else (64, 100)  # 100: a partial last program
    if data == "special":
        x = _special(*shape, 9).to(dtype)
        x[16:32] *= 1e-30  # a block whose E4M3 scale underflows to zero
    else:  # one magnitude: the transform's rounding to the input dtype decides ties and the amax
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    t_seed = 1234 if random_signs else None
    d = signs(t_seed, 16) if random_signs else None
    h = fp4train.hadamard(x, 16, axis=0, seed=t_seed)
    assert torch.equal(hadamard_finite_amax(x.to(DEV), d, 16).cpu(), h.float().nan_to_num(0, 0, 0).abs().amax())
    seed = 99 if rounding == "stochastic" else None
    ref = fp4train.quantize(h, "nvfp4", axis=0, rounding=rounding, seed=seed, four_over_six=four_over_six)
    if packed:
        got = quantize_nvfp4_columns(x.to(DEV), rounding=rounding, seed=seed, hadamard=True, signs=d, four_over_six=four_over_six)
        assert got.layout == ref.layout and torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        assert torch.equal(got.tensor_scale.cpu(), ref.tensor_scale)
    else:
        got = nvfp4_values(x.to(DEV), axis=0, rounding=rounding, seed=seed, hadamard=True, signs=d, four_over_six=four_over_six)
        want = ref.scaled_bf16()
        torch.testing.assert_close(got.values.cpu(), want.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got.divisor.cpu(), want.divisor)


def test_nvfp4_fused_hadamard_refuses_what_it_does_not_cover():
    from fp4train.kernels import nvfp4_values
    from fp4train.kernels.dispatch import hadamard_quantize_kernel

    with pytest.raises(ValueError, match="axis 0 only"):
        nvfp4_values(torch.randn(32, 32, device=DEV), axis=1, hadamard=True)
    with pytest.raises(ValueError, match="float32/bfloat16, got torch.float16"):
        nvfp4_values(torch.randn(32, 32, device=DEV).half(), axis=0, hadamard=True)
    kw = dict(rounding="stochastic")
    for ok in (kw, dict(kw, four_over_six=True)):
        assert hadamard_quantize_kernel((32, 64), torch.bfloat16, "nvfp4", ok, 0, 16, False) is not None
    for args in (((32, 64), torch.bfloat16, "nvfp4", kw, 1, 16), ((32, 64), torch.bfloat16, "nvfp4", kw, 0, 32),
                 ((32, 64), torch.float16, "nvfp4", kw, 0, 16), ((32, 64), torch.bfloat16, "mxfp4", kw, 0, 16),
                 ((24, 64), torch.bfloat16, "nvfp4", kw, 0, 16)):
        assert hadamard_quantize_kernel(*args, packed=True) is None, args


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rowwise_values_kernel_is_the_scaled_reference(axis, dtype):
    from fp4train.kernels import fp8_rowwise_values

    big = DEV == "cuda"
    x = _special(512 if big else 64, 1024 if big else 96, 6).to(dtype).to(DEV)
    x[:, 20] = 0.0
    x[20] = 0.0  # an all-zero row and column: scale 1
    ref = fp4train.quantize(x, "fp8", axis=axis).scaled_bf16()
    got = fp8_rowwise_values(x, axis=axis)
    assert got.block_axis == axis and got.divisor is None
    torch.testing.assert_close(got.values, ref.values, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.scale, ref.scale, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("axis", [1, 0, "tiles"])
@pytest.mark.parametrize("transposed", [False, True])
def test_decode_kernel_is_scaled_bf16(fmt, axis, transposed):
    """Codes + scales -> exact BF16 values (the saved X, MXFP8 operands), 1D blocks along either axis
    or square tiles, viewed either way: ``scaled_bf16()`` of the reference, NaN blocks and -0 included."""
    from fp4train.kernels import decode_scaled_bf16

    big = DEV == "cuda"
    x = _special(512 if big else 64, 1024 if big else 96, 7).to(DEV)
    x[5, 3] = -0.0
    if fmt == "nvfp4":  # one tensor scale: the 3.3e38 element would flush every other block to zero
        x = x.clamp(-1e6, 1e6)
    if axis == "tiles":
        q = fp4train.quantize(x, fmt, block=(16, 16) if fmt == "nvfp4" else (32, 32), rounding="stochastic", seed=3)
    else:
        q = fp4train.quantize(x, fmt, axis=axis, rounding="stochastic", seed=3)
    if transposed:
        q = q.t()
    ref = q.scaled_bf16()
    got = decode_scaled_bf16(q)
    assert got.block_axis == ref.block_axis and got.shape == ref.shape
    assert torch.equal(got.values.isnan(), ref.values.isnan()) and bool(ref.values.isnan().any())
    num = ~ref.values.isnan()  # (a NaN's sign bit carries nothing)
    assert torch.equal(torch.signbit(got.values)[num], torch.signbit(ref.values)[num]) and bool(torch.signbit(ref.values[num]).any())
    torch.testing.assert_close(got.values, ref.values, rtol=0, atol=0, equal_nan=True)
    assert (got.divisor is None) == (ref.divisor is None)


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("scale", ["floor", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp4_fp8_fold_kernel_equals_quantize_then_fold(group_rows, scale, rounding):
    from fp4train.formats.fold import fold
    from fp4train.kernels.mx_fold import quantize_mxfp4_fp8

    g = torch.Generator().manual_seed(8)
    rows = 200 if group_rows == 128 else 40  # a partial last 128-row group
    x = torch.randn(rows, 256, generator=g) * torch.logspace(-8, 8, 256)  # wide spans: inexact elements exist
    x[3, 5], x[7, 130], x[9, :32] = float("nan"), float("inf"), 0.0
    x = x.to(DEV)
    seed = 9 if rounding == "stochastic" else None
    ref = fold(fp4train.quantize(x, "mxfp4", scale=scale, rounding=rounding, seed=seed), group_rows)
    counter = torch.zeros((), dtype=torch.int32, device=DEV)
    got = quantize_mxfp4_fp8(x, group_rows=group_rows, scale=scale, rounding=rounding, seed=seed, counter=counter)
    assert torch.equal(got.codes, ref.codes)
    torch.testing.assert_close(got.scales, ref.scales, rtol=0, atol=0, equal_nan=True)
    assert ref.inexact > 0 and int(counter) == ref.inexact and got.inexact is counter


@pytest.mark.parametrize("group_rows", [1, 128])
def test_fold_of_packed_mxfp4_equals_reference_fold(group_rows):
    from fp4train.formats.fold import fold
    from fp4train.kernels.mx_fold import fold_packed_mxfp4

    g = torch.Generator().manual_seed(10)
    rows = 200 if group_rows == 128 else 40
    x = torch.randn(rows, 256, generator=g) * torch.logspace(-8, 8, 256)
    x[3, 5], x[7, 130], x[9, :32] = float("nan"), float("inf"), 0.0
    q = fp4train.quantize(x.to(DEV), "mxfp4", rounding="stochastic", seed=4)
    ref = fold(q, group_rows)
    got = fold_packed_mxfp4(q.codes, q.scales, group_rows=group_rows)
    assert torch.equal(got.codes, ref.codes)
    torch.testing.assert_close(got.scales, ref.scales, rtol=0, atol=0, equal_nan=True)
    assert int(got.inexact) == ref.inexact > 0
    for rb, nw in ((4, 4), (64, 8)):  # launch tuning: the same bits
        t = fold_packed_mxfp4(q.codes, q.scales, group_rows=group_rows, rows_per_program=rb, num_warps=nw)
        assert torch.equal(t.codes, ref.codes)
        torch.testing.assert_close(t.scales, ref.scales, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("transposed,group_rows,per_row", [(False, 1, False), (False, 128, False), (True, 128, False), (True, 128, True)])
def test_tile_fold_kernel_equals_the_reference_fold_in_either_orientation(transposed, group_rows, per_row):
    """32x32-tile MXFP4 (tib2d's W and dY) folded straight from its packed codes and tile scales, along
    the stored columns or - transposed, read in place - the stored rows: ``formats.fold`` of the same
    values as 1x32 blocks along the operand's inner dim, bit for bit, inexact count included."""
    from fp4train.formats import e2m1
    from fp4train.formats.fold import fold
    from fp4train.formats.layout import BlockLayout
    from fp4train.formats.qtensor import QuantizedTensor
    from fp4train.kernels.mx_fold import fold_tiles_mxfp4

    g = torch.Generator().manual_seed(17)
    x = torch.randn(256, 384, generator=g) * torch.logspace(-9, 9, 384)[None, :] * torch.logspace(-3, 3, 256)[:, None]
    x[40, 70] = float("nan")  # one NaN tile
    q = fp4train.quantize(x, "mxfp4", block=(32, 32), scale="ceil")
    codes = e2m1.unpack(q.codes)  # [256, 384] stored element codes
    tile_e = q.scales.repeat_interleave(32, 0).repeat_interleave(32, 1)  # each element's tile scale byte
    if transposed:
        codes, tile_e = codes.t().contiguous(), tile_e.t().contiguous()
    rows, k = codes.shape
    as_1x32 = QuantizedTensor("mxfp4", e2m1.pack(codes), tile_e[:, ::32].contiguous(), None, BlockLayout((rows, k), (32,), 1),
                              torch.float32)
    ref = fold(as_1x32, group_rows)
    got = fold_tiles_mxfp4(q.codes.to(DEV), q.scales.to(DEV), transposed=transposed, group_rows=group_rows, scale_per_row=per_row)
    assert got.codes.shape == (rows, k) and torch.equal(got.codes.cpu(), ref.codes)
    want_scales = ref.scales.repeat_interleave(128, 0) if per_row else ref.scales
    torch.testing.assert_close(got.scales.cpu(), want_scales, rtol=0, atol=0, equal_nan=True)
    assert got.group_rows == (1 if per_row else group_rows)
    assert int(got.inexact) == ref.inexact > 0 and bool(got.scales.isnan().any())
    for rb, nw in ((2, 2), (32, 4)):  # launch tuning: the same bits
        t = fold_tiles_mxfp4(q.codes.to(DEV), q.scales.to(DEV), transposed=transposed, group_rows=group_rows,
                             scale_per_row=per_row, rows_per_program=rb, num_warps=nw)
        assert torch.equal(t.codes.cpu(), ref.codes)
        torch.testing.assert_close(t.scales.cpu(), want_scales, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("tile,transposed,group_rows,per_row",
                         [(False, False, 1, False), (False, False, 128, False), (True, False, 1, False),
                          (True, False, 128, False), (True, True, 128, False), (True, True, 128, True)])
def test_packed_folds_usual_path_every_code_equals_the_reference(tile, transposed, group_rows, per_row):
    """The packed folds' usual path (every block within 11 binades of its group's top: four codes folded
    at once in a 32-bit word) - the tests above hold wide-span data, which takes the per-element path.
    Block scales spread over 8 binades, every E2M1 code, -0.0 and all-zero blocks; 1x32 blocks and
    32x32 tiles, either orientation; and the codes read from a view at an odd address."""
    from fp4train.formats import e2m1
    from fp4train.formats.fold import fold
    from fp4train.formats.layout import BlockLayout
    from fp4train.formats.qtensor import QuantizedTensor
    from fp4train.kernels.mx_fold import fold_packed_mxfp4, fold_tiles_mxfp4

    g = torch.Generator().manual_seed(23)
    rows, cols = 256, 384
    block = (32, 32) if tile else (1, 32)
    exps = torch.randint(-4, 5, (rows // block[0], cols // 32), generator=g).float()
    x = torch.randn(rows, cols, generator=g) * (2.0 ** exps).repeat_interleave(block[0], 0).repeat_interleave(32, 1)
    x[5, :] = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0] * 48) * torch.tensor([1.0, -1.0]).repeat_interleave(8).repeat(24)
    x[6, 64:96], x[7, 3], x[40:72, 160:192] = 0.0, -0.0, 0.0  # a zero block, a negative zero, a zero tile
    q = fp4train.quantize(x, "mxfp4", block=32 if not tile else (32, 32), scale="ceil" if tile else "floor")
    codes = e2m1.unpack(q.codes)
    assert set(codes.unique().tolist()) == set(range(16))  # every code, 8 (-0) included
    if tile:
        tile_e = q.scales.repeat_interleave(32, 0).repeat_interleave(32, 1)
        if transposed:
            codes, tile_e = codes.t().contiguous(), tile_e.t().contiguous()
        ref = fold(QuantizedTensor("mxfp4", e2m1.pack(codes), tile_e[:, ::32].contiguous(), None,
                                   BlockLayout(tuple(codes.shape), (32,), 1), torch.float32), group_rows)
    else:
        ref = fold(q, group_rows)
    assert ref.inexact == 0
    spare = torch.zeros(q.codes.numel() + 1, dtype=torch.uint8, device=DEV)
    odd = spare[1:].view(q.codes.shape)  # the same codes at an odd address (copied to an aligned buffer first)
    odd.copy_(q.codes.to(DEV))
    for c in (q.codes.to(DEV), odd):
        if tile:
            got = fold_tiles_mxfp4(c, q.scales.to(DEV), transposed=transposed, group_rows=group_rows, scale_per_row=per_row)
        else:
            got = fold_packed_mxfp4(c, q.scales.to(DEV), group_rows=group_rows)
        assert torch.equal(got.codes.cpu(), ref.codes)
        want = ref.scales.repeat_interleave(128, 0) if per_row else ref.scales
        torch.testing.assert_close(got.scales.cpu(), want, rtol=0, atol=0)
        assert int(got.inexact) == 0


@pytest.mark.parametrize("scale,rounding", [(("floor", "floor"), ("nearest", "nearest")), (("ceil", "floor"), ("nearest", "stochastic"))])
def test_fold_and_columns_kernel_is_both_reference_operands(scale, rounding):
    """X read once: the fprop operand (MXFP4 along K folded into 1x128 FP8 groups) and the wgrad
    operand (MXFP4 along M, packed), each equal to its own reference bit for bit."""
    from fp4train.formats.fold import fold
    from fp4train.kernels.mx_fold import quantize_mxfp4_fp8_and_columns

    x = _special(64, 256, 21)
    x[40:44, 128:] *= 2.0**-20  # blocks far below their group's largest: inexact after folding
    seeds = (5, 2**41 + 3)
    counter = torch.zeros((), dtype=torch.int32, device=DEV)
    folded, cols = quantize_mxfp4_fp8_and_columns(x.to(DEV), scale=scale, rounding=rounding, seed=seeds, counter=counter)
    ref_r = fp4train.quantize(x, "mxfp4", axis=-1, scale=scale[0], rounding=rounding[0], seed=seeds[0])
    ref_c = fp4train.quantize(x, "mxfp4", axis=0, scale=scale[1], rounding=rounding[1], seed=seeds[1])
    want = fold(ref_r, group_rows=1)
    assert torch.equal(folded.codes.cpu(), want.codes)
    torch.testing.assert_close(folded.scales.cpu(), want.scales, rtol=0, atol=0, equal_nan=True)
    assert int(counter) == want.inexact > 0
    assert cols.layout == ref_c.layout and torch.equal(cols.codes.cpu(), ref_c.codes) and torch.equal(cols.scales.cpu(), ref_c.scales)
    with pytest.raises(ValueError, match="M % 32 == 0 and K % 128 == 0"):
        quantize_mxfp4_fp8_and_columns(torch.randn(64, 96, device=DEV))


@pytest.mark.parametrize("block,signed", [(32, False), (16, True), (128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_fold_kernel_with_fused_hadamard_equals_transform_then_quantize_then_fold(block, signed, dtype, group_rows, rounding):
    from fp4train.formats.fold import fold
    from fp4train.kernels import quantize_mxfp4_fp8
    from fp4train.transforms.hadamard import signs

    x = _special(130, 256, 8).to(dtype)
    ref = fold(fp4train.quantize(fp4train.hadamard(x, block, axis=-1, seed=7 if signed else None), "mxfp4", rounding=rounding,
                                 seed=3), group_rows)
    # launch tuning and the butterflies' form (permutes or sums): the same bits
    launches = [(None, None, "permutes"), (None, None, "sums")] + ([(8, 4, "permutes"), (32, 4, "sums")] if group_rows == 1 and block == 32 else [])
    for rb, nw, butterfly in launches:
        got = quantize_mxfp4_fp8(x.to(DEV), group_rows=group_rows, rounding=rounding, seed=3, hadamard_block=block,
                                 hadamard_signs=signs(7, block) if signed else None, rows_per_program=rb, num_warps=nw,
                                 butterfly=butterfly)
        assert torch.equal(got.codes.cpu(), ref.codes)
        torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True)
        assert int(got.inexact) == ref.inexact


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fold_kernel_near_and_general_paths_each_equal_the_reference(group_rows, rounding):
    """The fold kernel codes a tile whose (nonzero) blocks all lie within 11 binades of their group's
    top by integer arithmetic (the usual case), any other tile by the general E4M3 rounding with the
    inexact count. One tensor with both kinds of tile, and tiles exactly at the limit (d = 11, near;
    d = 12, general: there E2M1's 0.5 becomes an E4M3 subnormal): each equal to the reference fold."""
    from fp4train.formats.fold import fold
    from fp4train.kernels import quantize_mxfp4_fp8

    g = torch.Generator().manual_seed(31)
    x = (torch.randn(512, 256, generator=g) * 0.9).clamp(-3.9, 3.9)  # block exponents 0 or below: group top e = 0
    x[0:16, 0:32] *= 2.0**-14  # rows 0..127: blocks 14 binades down -> general path (E4M3 subnormals)
    x[130, 160:192] *= 2.0**-30  # rows 128..255: far below -> inexact elements
    x[300, 64:96] = 0.0  # rows 256..383: an all-zero block does not force the general path
    grid = torch.tensor([4.0, 0.5, 1.0, 1.5, 2.0, 3.0, -0.5, -4.0])  # every E2M1 magnitude at scale 1
    for row, k in ((272, 11), (400, 12)):  # one block exactly k binades below its group's top (4.0 -> e = 0)
        x[row, 0] = 4.0
        x[row, 32:64] = 0.0
        x[row, 32:40] = grid * 2.0**-k
    ref = fold(fp4train.quantize(x, "mxfp4", rounding=rounding, seed=4), group_rows)
    got = quantize_mxfp4_fp8(x.to(DEV), group_rows=group_rows, rounding=rounding, seed=4)
    assert torch.equal(got.codes.cpu(), ref.codes)
    torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0)
    assert int(got.inexact) == ref.inexact > 0
    assert int(ref.codes[400, 33]) & 0x7F == 4  # 0.5 * 2**-12 relative: the E4M3 subnormal 2**-7 (the general path's case)


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("scale,rounding", [("floor", "nearest"), ("ceil", "nearest"), ("floor", "stochastic"), ("ceil", "stochastic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_kernel_ties_signs_and_subnormal_inputs_equal_the_reference(group_rows, scale, rounding, dtype):
    """The fold rounds in float arithmetic (nearest: ``x * 2**(6 - g)`` onto the block's scaled E2M1
    grid; stochastic: ``x * 2**-e`` between its grid neighbours): every tie (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7), the saturation above 6, negative
    values that round to -0, -0.0 itself, blocks 0..17 binades below their group's top (exact in E4M3
    up to 14, then E4M3 subnormals, rounding and the inexact count), and blocks of FP32 subnormals
    (exponent clamped at -127), each against the reference fold."""
    from fp4train.formats.fold import fold
    from fp4train.kernels import quantize_mxfp4_fp8

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, 7.99, 0.1, 0.26, 0.74, 2.99, 4.5, 5.9])
    rows = []
    for d in range(18):
        for sign in (1.0, -1.0):
            row = torch.zeros(128)
            row[0] = 4.0 * 2.0**3  # block 0 sets the group's top exponent (e = 3)
            row[32:48] = sign * ties * 2.0 ** (3 - d)  # block 1: e = 3 - d (its max 7.99 * 2**e)
            row[48] = -0.0
            row[64:80] = -ties * 2.0 ** (3 - min(d + 1, 14))
            row[96:112] = ties.flip(0) * 2.0**3
            rows.append(row)
    tiny = torch.tensor([1e-39, -3e-39, 5e-40, 1.1e-38, -1.17e-38, 2e-45, 0.0, -0.0]).repeat(16)  # FP32 subnormals
    if dtype == torch.float32 or DEV == "cuda":  # Triton's CPU interpreter converts BF16 subnormals wrongly (1e-39 -> 4.4e-39)
        rows.append(tiny)
    x = torch.stack(rows + [torch.linspace(-7.5, 7.5, 128) * 2.0 ** (k % 9 - 4) for k in range(256 - len(rows))])
    if rounding == "stochastic" and dtype == torch.float32:  # u exactly equal to the rounding fraction: stays down
        from fp4train import counter_rng

        u = counter_rng.uniform(21, (x.numel(),)).reshape(x.shape)
        x[200, 0], x[200, 1:32] = 4.0, 0.5 * u[200, 1:32]  # block exponent 0; (x - 0) / 0.5 == u exactly
    x = x.to(dtype)
    ref = fold(fp4train.quantize(x, "mxfp4", scale=scale, rounding=rounding, seed=21), group_rows)
    got = quantize_mxfp4_fp8(x.to(DEV), group_rows=group_rows, scale=scale, rounding=rounding, seed=21)
    assert torch.equal(got.codes.cpu(), ref.codes)
    torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0)
    assert int(got.inexact) == ref.inexact
    assert (ref.codes == 0x80).any()  # -0 codes are there to be got wrong


@pytest.mark.slow  # a sweep of launches through the interpreter
@pytest.mark.parametrize("axis", [1, 0])
def test_fold_kernel_launch_tuning_does_not_change_the_bits(axis):
    """rows_per_program / num_warps (what launch tuning varies) are launch tuning only."""
    from fp4train.kernels import quantize_mxfp4_fp8

    x = _special(256, 256, 14).to(DEV)
    for rounding in ("stochastic", "nearest"):
        want = quantize_mxfp4_fp8(x, axis=axis, group_rows=1, rounding=rounding, seed=2)
        for rb, nw in ((1, 1), (4, 2), (32, 8), (128, 4)):
            got = quantize_mxfp4_fp8(x, axis=axis, group_rows=1, rounding=rounding, seed=2, rows_per_program=rb, num_warps=nw)
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales.isnan(), want.scales.isnan())
            torch.testing.assert_close(got.scales, want.scales, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="power of two"):
        quantize_mxfp4_fp8(x, group_rows=1, rows_per_program=12)


def test_fold_launch_follows_the_reads_not_the_axis(monkeypatch):
    """The default launch is chosen by whether the block dim is read with a stride (FOLD_LAUNCH*'s key): a transposed
    view folded along dim 1 reads memory as the row-major tensor folded along dim 0 does, and takes its launch (and
    gives its bits); a row-major tensor along dim 1 takes the contiguous launch."""
    from fp4train.kernels import mx_fold

    x = _special(256, 128, 3).to(torch.bfloat16).to(DEV)
    assert mx_fold.block_dim_strided(x.stride(), 0) and mx_fold.block_dim_strided(x.t().stride(), 1)
    assert not mx_fold.block_dim_strided(x.stride(), 1) and not mx_fold.block_dim_strided(x.t().stride(), 0)
    launches = []
    real = mx_fold._fold_kernel

    class Spy:  # records each launch's rows per program, warps and butterfly form, then runs the kernel
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append((kw["RB"], kw["num_warps"], "sums" if kw["SUMS"] else "permutes"))
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(mx_fold, "_fold_kernel", Spy())
    for gr in (1, 128):
        launches.clear()
        a = mx_fold.quantize_mxfp4_fp8(x, axis=0, group_rows=gr, hadamard_block=32)
        b = mx_fold.quantize_mxfp4_fp8(x.t(), axis=1, group_rows=gr, hadamard_block=32)
        c = mx_fold.quantize_mxfp4_fp8(x.t().contiguous(), axis=1, group_rows=gr, hadamard_block=32)
        assert launches[0] == launches[1] == mx_fold.fold_launch(True, gr, True) and launches[2] == mx_fold.fold_launch(False, gr, True)
        for got in (b, c):  # the same bits (the scales hold NaN for _special's NaN blocks)
            assert torch.equal(got.codes, a.codes) and int(got.inexact) == int(a.inexact)
            torch.testing.assert_close(got.scales, a.scales, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("had", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_rows", [1, 128])
def test_fold_kernel_along_dim_0_reads_x_in_place_as_its_transpose(had, dtype, group_rows):
    """Blocks along x's dim 0 (W along N for dgrad, dY along M for wgrad): the fold of x^T, bit for
    bit, read through strides - no transposed copy first (a strided copy kernel that took 12% of a
    1b training step's GPU time on the H200). A non-contiguous x (a column slice) is read as it is."""
    from fp4train.formats.fold import fold
    from fp4train.kernels import quantize_mxfp4_fp8
    from fp4train.transforms.hadamard import signs

    big = _special(256, 200, 12).to(dtype)
    big[100:104, 3] *= 2.0**-20  # a block far below its group: inexact after folding
    x = big[:, 8:168]  # [256, 160], row stride 200
    xt = x.t().contiguous()
    if had:
        xt = fp4train.hadamard(xt, had, axis=-1, seed=5)
    ref = fold(fp4train.quantize(xt, "mxfp4", rounding="stochastic", seed=11), group_rows)
    for butterfly in ("permutes", "sums") if had else ("permutes",):  # the fused transform's two forms: the same bits
        got = quantize_mxfp4_fp8(x.to(DEV), axis=0, group_rows=group_rows, rounding="stochastic", seed=11,
                                 hadamard_block=had, hadamard_signs=None if had is None else signs(5, had), butterfly=butterfly)
        assert got.codes.shape == (160, 256) and torch.equal(got.codes.cpu(), ref.codes)
        torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True)
        assert int(got.inexact) == ref.inexact
    with pytest.raises(ValueError, match="butterfly must be 'permutes' or 'sums'"):
        quantize_mxfp4_fp8(x.to(DEV), axis=0, group_rows=group_rows, hadamard_block=32, butterfly="shuffles")
    with pytest.raises(ValueError, match="dim 0 .the block dim. is a multiple of 128"):
        quantize_mxfp4_fp8(torch.randn(96, 128, device=DEV), axis=0, group_rows=1)


@pytest.mark.parametrize("fmt,rounding", [("mxfp4", "nearest"), ("mxfp4", "stochastic"), ("mxfp8", "nearest"), ("mxfp8", "stochastic"),
                                          ("nvfp4", "nearest"), ("nvfp4", "stochastic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_kernels_quantize_along_dim_0_without_a_transposed_copy(fmt, rounding, dtype):
    from fp4train.kernels.mx_quantize import quantize_mxfp4_columns, quantize_mxfp8_columns
    from fp4train.kernels.nvfp4_quantize import quantize_nvfp4_columns

    x = _special(64, 100, 12).to(dtype)  # K not a multiple of the program's 64 columns: a partial last program
    ref = fp4train.quantize(x, fmt, axis=0, rounding=rounding, seed=2**36 + 1)
    kw = dict(rounding=rounding, seed=2**36 + 1)
    mx = {"mxfp4": quantize_mxfp4_columns, "mxfp8": quantize_mxfp8_columns}.get(fmt)
    got = mx(x.to(DEV), scale="floor", **kw) if mx else quantize_nvfp4_columns(x.to(DEV), **kw)
    assert got.layout == ref.layout and torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
    if fmt == "nvfp4":
        assert torch.equal(got.tensor_scale.cpu(), ref.tensor_scale)
    torch.testing.assert_close(got.dequantize().cpu(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
    if mx:  # launch tuning: the same bits; and quantize() dispatches here, ceil scales too
        for bk, nw in ((32, 2), (128, 8)):
            t = mx(x.to(DEV), scale="floor", block_cols=bk, num_warps=nw, **kw)
            assert torch.equal(t.codes.cpu(), ref.codes) and torch.equal(t.scales.cpu(), ref.scales)
        ref_c = fp4train.quantize(x, fmt, axis=0, scale="ceil", rounding=rounding, seed=2**36 + 1)
        t = mx(x.to(DEV), scale="ceil", **kw)
        assert torch.equal(t.codes.cpu(), ref_c.codes) and torch.equal(t.scales.cpu(), ref_c.scales)
        with pytest.raises(ValueError, match="block_cols must be a power of two"):
            mx(x.to(DEV), block_cols=48)
        with pytest.raises(ValueError, match="dim 0 to be a multiple of 32"):
            mx(x[:40].to(DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("shape", [(70, 1100), (600, 150)])
def test_finite_amax_kernel_equals_the_reference_statistics(dtype, dim, shape):
    """NVFP4's tensor amax and FP8 rowwise's per-row/column amax in one pass: NaN and Inf count as 0
    and flag their row; equal to the reference's torch ops, on a non-contiguous view too. 600 rows: a
    column reduction split over three chunks of rows, merged by atomic max."""
    from fp4train.formats import nvfp4
    from fp4train.kernels.amax import finite_amax_along
    from fp4train.kernels.nvfp4_quantize import device_tensor_scale

    x = _special(*shape, 3).to(dtype)  # NaN in row 0, Inf in row 1 (see _special), huge and tiny values
    x[5, 7] = float("-inf")
    x[590 % shape[0], 9] = 1e30  # the largest value of a column in the last chunk

    for t in (x, x[:, 3:1030]):
        td = t.to(DEV)
        amax, bad = finite_amax_along(td, dim)
        finite = torch.isfinite(t)
        want = torch.where(finite, t.abs(), torch.zeros_like(t)).amax(dim=dim).float()
        assert torch.equal(amax.cpu(), want) and torch.equal(bad.cpu(), ~finite.all(dim=dim))
        assert bad.any()
        assert torch.equal(device_tensor_scale(td).cpu(), nvfp4.tensor_scale(t).reshape(1))
    with pytest.raises(ValueError, match="2D tensor and dim 0 or 1"):
        finite_amax_along(torch.ones(4, device=DEV), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [1, 0])
def test_fp8_rowwise_quantize_kernel_equals_the_reference(dtype, axis):
    """FP8 rowwise codes + scales in the reference's stored layout (the scaled axis last: x^T for
    axis 0, written transposed by the kernel), bit for bit: NaN/Inf rows, an all-zero row, -0.0,
    saturation; and what quantize() returns under triton numerics."""
    from fp4train.kernels.fp8_values import quantize_fp8_rowwise
    from fp4train.quantizer import Quantizer

    x = _special(70, 200, 5).to(dtype)
    x[11, 13], x[12, 14] = -0.0, 1e30 if dtype == torch.float32 else 3e38
    ref = fp4train.quantize(x, "fp8", axis=axis)
    got = quantize_fp8_rowwise(x.to(DEV), axis=axis)
    assert got.layout == ref.layout and torch.equal(got.codes.cpu(), ref.codes)
    torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True)
    assert bool(ref.scales.isnan().any()) and bool((ref.codes == 0x80).any())
    via = Quantizer("triton").quantize(x.to(DEV), "fp8", axis=axis)
    assert torch.equal(via.codes.cpu(), ref.codes)


def test_e2m1_nearest_rounding_at_every_tie_and_its_neighbours_equals_the_reference():
    """The kernels' E2M1 round-to-nearest-even (bit arithmetic from 1 up, two thresholds below): every
    midpoint between grid values, one FP32 ulp either side, the grid values, and values past 6 -
    each in a block whose largest element fixes the scale at 1 - against the reference, bit for bit."""
    from fp4train.formats.fold import fold
    from fp4train.kernels.mx_fold import quantize_mxfp4_fp8

    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 5.999, 6.0])
    vals = torch.cat([t, torch.nextafter(t, torch.full_like(t, 9.0)), torch.nextafter(t, torch.zeros_like(t))])
    vals = torch.cat([vals, -vals])  # 96 values: three blocks of 32 (with the 6.0s setting each block's scale to 1)
    x = torch.zeros(4, 128)
    x[0, :96] = vals
    x[1, :96] = vals.flip(0)
    x[2, :96] = vals * 2.0**-20  # the same at another scale exponent
    x[3, :96] = vals * 2.0**30
    x[:, 96:] = 7.9  # a block whose values round up past 6: saturation
    ref = fp4train.quantize(x, "mxfp4")
    got = quantize_mxfp4(x.to(DEV))
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
    assert torch.equal(quantize_mxfp4_fp8(x.to(DEV), group_rows=1).codes.cpu(), fold(ref, 1).codes)  # the fold kernel's rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(70, 200), (33, 129), (600, 72)])
def test_fp8_rowwise_both_layouts_from_two_reads_equal_the_reference(dtype, shape):
    """Both FP8 rowwise layouts of one tensor (the row and the column amax in one pass, both code
    layouts in another) equal quantize(x, "fp8", axis=1) and axis=0 bit for bit: NaN/Inf rows and
    columns, an all-zero row, -0.0, saturation, partial tiles."""
    from fp4train.kernels.fp8_values import quantize_fp8_rowwise_both

    x = _special(*shape, 5).to(dtype)
    x[11, 13], x[12, 14] = -0.0, 1e30 if dtype == torch.float32 else 3e38
    x[20] = 0.0
    rows, cols = quantize_fp8_rowwise_both(x.to(DEV))
    for got, axis in ((rows, 1), (cols, 0)):
        ref = fp4train.quantize(x, "fp8", axis=axis)
        assert got.layout == ref.layout and torch.equal(got.codes.cpu(), ref.codes), axis
        torch.testing.assert_close(got.scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True)
        assert bool(ref.scales.isnan().any())


def _device_keys_cases():
    """(name, launch(x, seed)) for every kernel that rounds stochastically: its outputs as a tuple of tensors."""
    from fp4train.kernels import (mxfp4_values, mxfp8_values, nvfp4_tile_values, nvfp4_values, quantize_mxfp4, quantize_mxfp4_2d,
                                  quantize_mxfp4_dual, quantize_mxfp4_fp8, quantize_mxfp8, quantize_mxfp8_2d, quantize_nvfp4,
                                  quantize_nvfp4_2d)
    from fp4train.kernels.mx_quantize import quantize_mxfp4_columns, quantize_mxfp8_columns
    from fp4train.kernels.nvfp4_quantize import quantize_nvfp4_columns

    sr = dict(rounding="stochastic")
    q = lambda t: (t.codes, t.scales)  # noqa: E731
    return [
        ("mxfp4", lambda x, s: q(quantize_mxfp4(x, seed=s, **sr))),
        ("mxfp4 even/odd", lambda x, s: q(quantize_mxfp4(x, seed=s, pairs=True, **sr))),
        ("mxfp8", lambda x, s: q(quantize_mxfp8(x, seed=s, **sr))),
        ("mxfp4 columns", lambda x, s: q(quantize_mxfp4_columns(x, seed=s, **sr))),
        ("mxfp8 columns", lambda x, s: q(quantize_mxfp8_columns(x, seed=s, **sr))),
        ("mxfp4 dual", lambda x, s: tuple(t for half in quantize_mxfp4_dual(x, rounding=("stochastic",) * 2, seed=(s, s))
                                          for t in q(half))),
        ("mxfp4 32x32 even/odd", lambda x, s: q(quantize_mxfp4_2d(x, seed=s, pairs=True, **sr))),
        ("mxfp4 32x32 general", lambda x, s: q(quantize_mxfp4_2d(x, seed=s, pairs=False, **sr))),
        ("mxfp8 32x32", lambda x, s: q(quantize_mxfp8_2d(x, seed=s, **sr))),
        ("mxfp4 values", lambda x, s: tuple(mxfp4_values(x, axis=a, seed=s, **sr).values for a in (1, 0, None))),
        ("mxfp8 values", lambda x, s: (mxfp8_values(x, axis=1, seed=s, **sr).values,)),
        ("mxfp4 -> fp8", lambda x, s: tuple(t for a in (1, 0) for t in q(quantize_mxfp4_fp8(x, group_rows=1, axis=a, seed=s, **sr)))),
        ("mxfp4 -> fp8 hadamard", lambda x, s: q(quantize_mxfp4_fp8(x, group_rows=128, seed=s, hadamard_block=32, **sr))),
        ("nvfp4", lambda x, s: q(quantize_nvfp4(x, seed=s, **sr))),
        ("nvfp4 columns", lambda x, s: q(quantize_nvfp4_columns(x, seed=s, **sr))),
        ("nvfp4 16x16", lambda x, s: (*q(quantize_nvfp4_2d(x, seed=s, **sr)), nvfp4_tile_values(x, seed=s, **sr).values)),
        ("nvfp4 values", lambda x, s: tuple(nvfp4_values(x, axis=a, seed=s, **sr).values for a in (1, 0))),
    ]


@pytest.mark.parametrize("case", range(17))
def test_stochastic_kernels_take_the_seed_from_the_device(case):
    """A seed that lives on the device - its keys as an int64 tensor there (counter_rng.seed_keys_tensor), what a
    CUDA graph can capture and replay with fresh values - gives every stochastic-rounding kernel the same bits as
    the same seed given as a host int; another seed gives other bits; keys of the wrong shape are refused."""
    from fp4train import counter_rng

    name, launch = _device_keys_cases()[case]
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(case)).to(DEV)  # finite: every draw shows
    seed = 2**40 + 12345 + case
    keys = counter_rng.seed_keys_tensor(torch.tensor(seed, dtype=torch.int64, device=DEV))
    bits = lambda t: t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t  # noqa: E731
    same = lambda a, b: len(a) == len(b) and all(torch.equal(bits(u), bits(v)) for u, v in zip(a, b))  # NaN blocks too  # noqa: E731
    host, device = launch(x, seed), launch(x, keys)
    assert same(host, device), name
    assert not same(host, launch(x, counter_rng.seed_keys_tensor(torch.tensor(seed + 1, dtype=torch.int64, device=DEV)))), name
    with pytest.raises(ValueError, match="int64 keys"):
        launch(x, keys[:1])


def test_seed_kernels_derive_the_reference_seeds_and_keys_bit_for_bit():
    """kernels/seeds.py (one launch each, what a CUDA graph replays instead of ~150 tiny int64 kernels per layer
    call): the stream's next seed and an operand's keys equal counter_rng's host ints and its tensor ops bit for
    bit - at the ends of the 62-bit range and with counts past 2**32 - and the stream's count advances in place."""
    from fp4train import counter_rng
    from fp4train.kernels.seeds import derived_keys, stream_next

    g = torch.Generator().manual_seed(9)
    seeds = torch.randint(0, 2**62, (24,), generator=g, dtype=torch.int64).tolist() + [0, 1, 2**32 - 1, 2**32, 2**62 - 1]
    for s in seeds:
        t = torch.tensor(s, dtype=torch.int64, device=DEV)
        for salt in ((), (0,), (2,), (0, 0), (1, 2), (2, 1), (2**32 - 1, 7)):
            want = list(counter_rng.seed_keys(counter_rng.derive_seed(s, *salt)))
            assert derived_keys(t, *salt).tolist() == want, (s, salt)
            assert derived_keys(t.reshape(1), *salt).tolist() == want  # the graph op's seed output is shape (1,)
        assert counter_rng.seed_keys_tensor(counter_rng.derive_seed_tensor(t.cpu(), 1, 2)).tolist() == \
            derived_keys(t, 1, 2).tolist()  # the tensor-op reference agrees too
        for c in (0, 5, 2**32 - 1, 2**32 + 3):
            count = torch.tensor(c, dtype=torch.int64, device=DEV)
            assert stream_next(t, count).item() == counter_rng.derive_seed(s, c + 1), (s, c)
            assert count.item() == c + 1
    with pytest.raises(ValueError, match="one int64 element"):
        derived_keys(torch.zeros(2, dtype=torch.int64, device=DEV), 1)
    with pytest.raises(ValueError, match="up to two salts"):
        derived_keys(torch.zeros((), dtype=torch.int64, device=DEV), 1, 2, 3)


@triton.jit
def _block_sums_kernel(t_ptr, rows_ptr, tiles_ptr, N: tl.constexpr):
    r = tl.arange(0, N)[:, None]
    t = tl.load(t_ptr + r * 16 + tl.arange(0, 16)[None, :])  # [N, 16]: N blocks of 16, or N // 16 tiles of 256
    tl.store(rows_ptr + tl.arange(0, N), _pairwise_sum16(t))
    i = tl.arange(0, 16)[:, None, None]  # tile (row within the tile, tile, byte): the tile kernel's even/odd view
    tile = tl.arange(0, N // 16)[None, :, None]
    k = tl.arange(0, 8)[None, None, :]
    even = tl.load(t_ptr + tile * 256 + i * 16 + 2 * k)
    tl.store(tiles_ptr + tl.arange(0, N // 16), _tile_sum(even, tl.load(t_ptr + tile * 256 + i * 16 + 2 * k + 1), N // 16))


def test_four_over_six_kernels_sum_the_errors_in_the_references_tree():
    """4/6 compares two sums of squared errors, so the kernels must add them in the reference's order
    (:func:`fp4train.formats.nvfp4.pairwise_sum`) - a block (or 16x16 tile) whose two sums are equal in one order
    and not in another would otherwise choose another scale. Terms of wildly different sizes make every order
    give another float: the blocks' and the tiles' sums must be the reference's all the same."""
    from fp4train.formats.nvfp4 import pairwise_sum

    g = torch.Generator().manual_seed(4)
    t = torch.exp2(torch.randint(-30, 30, (64, 16), generator=g).float()) * (1 + torch.rand(64, 16, generator=g))
    rows, tiles = torch.empty(64, device=DEV), torch.empty(4, device=DEV)
    _block_sums_kernel[(1,)](t.to(DEV), rows, tiles, N=64)
    assert not torch.equal(pairwise_sum(t), t.sum(-1)) and not torch.equal(pairwise_sum(t), t.flip(-1).cumsum(-1)[:, -1])
    assert torch.equal(rows.cpu(), pairwise_sum(t))
    assert torch.equal(tiles.cpu(), pairwise_sum(t.reshape(4, 256)))


def test_nvfp4_kernels_take_the_next_block_scale_under_sr_where_the_nearest_saturates():
    """Every NVFP4 kernel (1x16 rows and columns, the BF16 values along both axes, 16x16 tiles) makes the
    reference's SR scale choice on blocks whose nearest E4M3 scale rounds down past E2M1's 6: one code up,
    bit for bit - and those blocks are there (nearest and SR scales differ on them)."""
    from fp4train.kernels import nvfp4_values, quantize_nvfp4
    from fp4train.kernels.nvfp4_quantize import quantize_nvfp4_columns
    from fp4train.kernels.nvfp4_tiles import quantize_nvfp4_2d

    g = torch.Generator().manual_seed(4)
    x = torch.rand(32, 64, generator=g) * 2 - 1
    x[0, 0] = 448.0  # s_enc = 6
    x[1:, :] *= 0.9  # below the block maxima set next
    x[1:, ::16] = 1.06  # (1.06 / 6) * s_enc = 1.06: the nearest E4M3 scale is 1.0, so the maximum scales to 6.36
    seed = 2**35 + 11
    for axis, (kern, kw) in ((1, (quantize_nvfp4, {})), (0, (quantize_nvfp4_columns, {"axis": 0}))):
        ref = fp4train.quantize(x, "nvfp4", rounding="stochastic", seed=seed, **kw)
        assert (ref.scales != fp4train.quantize(x, "nvfp4", **kw).scales).any()
        got = kern(x.to(DEV), rounding="stochastic", seed=seed)
        assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
        vals = nvfp4_values(x.to(DEV), axis=axis, rounding="stochastic", seed=seed)
        assert torch.equal(vals.values.cpu(), ref.scaled_bf16().values)
    xt = x.clone()
    xt[1:, :] = x[1:, :] * 0.5  # rows 1..: 16x16 tiles whose maxima (1.06 x 0.5 against 448) also round down
    ref = fp4train.quantize(xt, "nvfp4", block=(16, 16), rounding="stochastic", seed=seed)
    got = quantize_nvfp4_2d(xt.to(DEV), rounding="stochastic", seed=seed)
    assert (ref.scales != fp4train.quantize(xt, "nvfp4", block=(16, 16)).scales).any()
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)


@pytest.mark.parametrize("factors", ["divisors", "row_scales", "all", "none"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_output_factors_in_one_pass_equal_the_reference_ops(factors, out_dtype):
    """Triton numerics' BF16-GEMM epilogue: A's and B's row scales, then the two divisors, one rounding each, then
    the cast (round to nearest even: every tie and its neighbours, NaN, inf, -0, values that overflow BF16)."""
    from fp4train.backends.emulated import scale_output as reference
    from fp4train.kernels.gemm_epilogue import scale_output

    g = torch.Generator().manual_seed(7)
    m, n = 37, 300
    out = torch.randn(m, n, generator=g) * torch.logspace(-35, 35, n)
    ties = torch.arange(-2**15, 2**15, dtype=torch.int32)[: m * 40] + (0x3F80 << 16)  # BF16 ties and neighbours of 1.0
    out.view(torch.int32)[:, :40] = (ties.reshape(-1)[: m * 40].reshape(m, 40) & 0xFFFF) | (0x3F80 << 16)
    out[0, 40:46] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3.39e38, -3.3e38])
    ra, rb = torch.rand(m, generator=g) * 4, torch.rand(n, generator=g) / 3
    da, db = torch.tensor(3.7e-3), torch.tensor(448 * 6 / 0.37)
    args = {"divisors": (None, None, da, db), "row_scales": (ra, rb, None, None), "all": (ra, rb, da, db),
            "none": (None, None, None, None)}[factors]
    want = reference(out.clone().to(DEV), *[a.to(DEV) if a is not None else None for a in args], out_dtype)
    got = scale_output(out.clone().to(DEV), *[a.to(DEV) if a is not None else None for a in args], out_dtype)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    nan = want.isnan()
    assert got.dtype == out_dtype and torch.equal(got.isnan(), nan)  # NaN stays NaN (its payload bits may differ)
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]) and nan.any()
