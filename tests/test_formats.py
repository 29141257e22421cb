"""MXFP4 / NVFP4 / MXFP8 / FP8 quantization against their definitions (docs/methods.md, Formats)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4train
from fp4train import quantize
from fp4train.formats import e4m3

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ALL = ["mxfp4", "nvfp4", "mxfp8", "fp8"]


def mx_scale(q):
    """Per-element float scale of a 1D-blocked MX tensor (logical layout)."""
    s = q.scale_values().repeat_interleave(q.layout.block[0], -1)
    return s[..., : q.layout.shape[-1]]


def on_grid(values: torch.Tensor) -> bool:
    return bool(torch.isin(values.abs(), GRID).all())


# ---- MX scale rules --------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mx_scale_matches_the_formula(rule):
    torch.manual_seed(0)
    x = torch.randn(64, 32) * torch.logspace(-30, 30, 64)[:, None]
    x[:8] = 2.0 ** torch.arange(-20, -12).float()[:, None]  # exact powers of two
    x[8:16, 0] = 6.0 * 2.0 ** torch.arange(8).float()  # amax exactly 6 * 2**k
    q = quantize(x, "mxfp4", scale=rule)
    amax = x.abs().amax(-1).double()
    if rule == "floor":
        expect = [2.0 ** (math.floor(math.log2(a)) - 2) for a in amax.tolist()]
    else:
        expect = [2.0 ** math.ceil(math.log2(a / 6)) for a in amax.tolist()]
    assert q.scale_values().squeeze(-1).double().tolist() == expect


def test_floor_clips_above_six_times_scale_and_ceil_never_clips():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 7.0, 1.0  # amax 7: floor scale 1 -> 7 clips to 6; ceil scale 2
    fl = quantize(x, "mxfp4", scale="floor")
    ce = quantize(x, "mxfp4", scale="ceil")
    assert fl.scale_values().item() == 1.0 and fl.dequantize()[0, 0].item() == 6.0
    assert ce.scale_values().item() == 2.0 and ce.dequantize()[0, 0].item() == 8.0


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_floor_amax_ratio_in_4_8_and_ceil_in_3_6(rule):
    torch.manual_seed(1)
    x = torch.randn(512, 32) * torch.rand(512, 1) * 100
    q = quantize(x, "mxfp4", scale=rule)
    ratio = x.abs().amax(-1) / q.scale_values().squeeze(-1)
    lo, hi = (4.0, 8.0) if rule == "floor" else (3.0, 6.0)
    assert ((ratio >= lo) & (ratio < hi) if rule == "floor" else (ratio > lo) & (ratio <= hi)).all()


@pytest.mark.parametrize("rule", ["floor", "ceil"])
@pytest.mark.parametrize("dist", ["gauss", "student_t", "outlier"])
def test_dequantized_values_lie_on_grid_times_scale(rule, dist):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 128, generator=g)
    if dist == "student_t":
        x = torch.distributions.StudentT(2.0).sample((96, 128))
    elif dist == "outlier":
        x[:, ::17] *= 100
    q = quantize(x, "mxfp4", scale=rule)
    d = q.dequantize()
    assert on_grid(d / mx_scale(q))
    assert torch.equal(d, q.element_values() * mx_scale(q))
    if rule == "ceil":  # no clipping: error at most half the largest step (2 * scale)
        assert ((d - x).abs() <= mx_scale(q)).all()


def test_mxfp8_scale_rule_and_saturation():
    x = torch.zeros(2, 32)
    x[0, 0] = 500.0  # floor(log2 500) = 8 -> scale 2**0, 500 clips to 448
    x[1, 0] = 300.0
    q = quantize(x, "mxfp8")
    assert q.scale_values().squeeze(-1).tolist() == [1.0, 1.0]
    assert q.dequantize()[:, 0].tolist() == [448.0, 288.0]  # 300 -> nearest E4M3 (step 32 in [256, 512))
    assert quantize(x, "mxfp8", scale="ceil").dequantize()[0, 0].item() == 512.0


# ---- NVFP4 -------------------------------------------------------------------------------------


def test_nvfp4_hand_computed_example():
    # block 0 amax 3 = tensor amax: s_enc = 2688 / 3 = 896; sb = e4m3(3 / 6 * 896) = 448;
    #   3 * 896 / 448 = 6 -> 6 * 448 / 896 = 3 (exact); 1.5 -> 3 -> 1.5 (exact)
    # block 1 amax 0.3: sb = e4m3(0.05 * 896 = 44.8) = 44 (E4M3 step 4 in [32, 64));
    #   0.3 * 896 / 44 = 6.109 -> saturates to 6 -> 6 * 44 / 896 = 0.294642857...
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16] = 3.0, 1.5, 0.3
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == pytest.approx(896.0)
    assert e4m3.decode(q.scales).squeeze().tolist() == [448.0, 44.0]
    d = q.dequantize()
    assert d[0, 0].item() == 3.0 and d[0, 1].item() == 1.5
    assert d[0, 16].item() == torch.tensor(6.0 * 44.0 / 896.0).item()


def test_nvfp4_values_are_grid_times_block_scale():
    torch.manual_seed(3)
    x = torch.randn(64, 64)
    q = quantize(x, "nvfp4")
    sb = e4m3.decode(q.scales).repeat_interleave(16, -1)
    assert torch.equal(q.dequantize(), (q.element_values() * sb) / q.tensor_scale)
    assert on_grid(q.element_values())
    assert torch.isin(e4m3.decode(q.scales), e4m3.decode(torch.arange(0, 127, dtype=torch.uint8))).all()


def test_nvfp4_four_over_six_never_worse_per_block():
    torch.manual_seed(4)
    x = torch.randn(128, 64) * torch.rand(128, 1)
    plain = quantize(x, "nvfp4", four_over_six=True)
    # per block, the chosen candidate has the smaller error of the two; compare to both by
    # re-quantizing with each target: the 4/6 error never exceeds the max->6-only error
    # computed under the same tensor scale.
    err = (plain.dequantize() - x).pow(2).reshape(128, 4, 16).sum(-1)
    from fp4train.formats import nvfp4 as nv

    xb = x.reshape(128, 4, 16)
    c6, s6 = nv.encode_blocks(xb, plain.tensor_scale, u=None, four_over_six=False)
    from fp4train.formats import e2m1

    d6 = (e2m1.decode(c6) * e4m3.decode(s6).unsqueeze(-1)) / plain.tensor_scale
    err6 = (d6 - xb).pow(2).sum(-1)
    assert (err <= err6).all() and (err < err6).any()


# ---- FP8 rowwise -------------------------------------------------------------------------------


def test_fp8_rowwise_scale_is_amax_over_448():
    x = torch.tensor([[448.0, 1.0, -2.0], [0.0, 0.0, 0.0], [1.0, -3.5, 0.25]])
    q = quantize(x, "fp8")
    assert q.scales.squeeze(-1).tolist() == [1.0, 1.0, 3.5 / 448]
    assert torch.equal(q.dequantize()[:2], x[:2])
    q0 = quantize(x, "fp8", axis=0)
    assert q0.scales.shape == (3, 1)  # one scale per column when blocked along axis 0


# ---- geometry: 1D along any axis, 2D tiles, padding -----------------------------------------


@pytest.mark.parametrize("fmt", ALL)
def test_axis_is_equivalent_to_moving_it_last(fmt):
    torch.manual_seed(5)
    x = torch.randn(48, 5, 64)
    a = quantize(x, fmt, axis=0).dequantize()
    b = quantize(x.movedim(0, -1), fmt).dequantize().movedim(-1, 0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
def test_non_divisible_dims_pad_and_crop(fmt):
    torch.manual_seed(6)
    x = torch.randn(7, 45)
    q = quantize(x, fmt)
    b = q.layout.block[0]
    assert q.dequantize().shape == x.shape
    padded = quantize(F.pad(x, (0, -45 % b)), fmt).dequantize()[:, :45]
    assert torch.equal(q.dequantize(), padded)
    q2 = quantize(x, fmt, block=(16, 16))
    assert q2.dequantize().shape == x.shape and q2.scales.shape == (1, 3)


@pytest.mark.parametrize("fmt,b", [("mxfp4", 32), ("nvfp4", 16), ("mxfp8", 32), ("mxfp4", 16)])
@pytest.mark.parametrize("shape", [(64, 96), (70, 50), (33, 129)])
def test_2d_tiles_are_transposition_invariant(fmt, b, shape):
    torch.manual_seed(7)
    W = torch.randn(*shape) * torch.rand(shape[0], 1) * torch.rand(1, shape[1]) * 10
    qt = quantize(W, fmt, block=(b, b)).t()
    q_of_t = quantize(W.T.contiguous(), fmt, block=(b, b))
    assert qt.shape == q_of_t.shape == W.T.shape
    assert torch.equal(qt.element_values(), q_of_t.element_values())  # codes, bit for bit
    assert torch.equal(qt.scales.mT, q_of_t.scales)
    assert torch.equal(qt.dequantize(), q_of_t.dequantize())


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_1d_blocks_are_not_transposition_invariant(fmt):
    torch.manual_seed(7)
    W = torch.randn(64, 96)
    along_k_then_t = quantize(W, fmt).t().dequantize()  # blocks along W's rows, transposed
    along_n = quantize(W.T.contiguous(), fmt).dequantize()  # blocks along W^T's rows
    assert not torch.equal(along_k_then_t, along_n)
    assert quantize(W, fmt).t().block_axis == 0  # the transpose has blocks along the other axis


def test_transpose_is_free():
    q = quantize(torch.randn(64, 64), "mxfp4", block=(32, 32))
    assert q.t().codes is q.codes and q.t().t().transposed is False
    with pytest.raises(ValueError, match="needs a 2D"):
        quantize(torch.randn(2, 64, 64), "mxfp4").t()


def test_packed_storage_bytes():
    q = quantize(torch.randn(256, 1024), "mxfp4")
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (256, 512)
    assert q.nbytes == 256 * 1024 // 2 + 256 * 1024 // 32  # 4.25 bits per element
    assert fp4train.FORMATS["mxfp4"].bits_per_element == 4.25


# ---- edge cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL)
def test_all_zero_blocks(fmt):
    x = torch.zeros(4, 64)
    x[1, 5] = 1.0
    q = quantize(x, fmt)
    assert torch.equal(q.dequantize(), x)
    if fmt in ("mxfp4", "mxfp8"):
        assert q.scales[0].tolist() == [0, 0]  # smallest E8M0 scale 2**-127
    assert not q.dequantize().signbit().any()


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_poisons_its_block_never_silently_finite(fmt, bad):
    torch.manual_seed(8)
    x = torch.randn(2, 64)
    x[0, 3] = bad
    d = quantize(x, fmt).dequantize()
    blk = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32, "fp8": 64}[fmt]
    assert torch.isnan(d[0, :blk]).all()  # the whole block holding it
    assert torch.isfinite(d[0, blk:]).all() and torch.isfinite(d[1]).all()  # nothing else


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_exact_roundtrip_of_grid_values_over_the_exponent_range(rule):
    for k in range(-120, 121, 7):
        x = torch.cat([GRID, -GRID]).repeat(2)[None] * 2.0**k  # amax 6 * 2**k
        assert torch.equal(quantize(x, "mxfp4", scale=rule).dequantize(), x), k


def test_subnormal_inputs_flush_toward_zero_but_never_nan():
    x = torch.tensor([[6.0, 3.0, 1e-45] + [0.0] * 29]) * 2.0**-130
    d = quantize(x, "mxfp4").dequantize()
    assert torch.isfinite(d).all()
    x2 = torch.full((1, 32), 1e-40)  # subnormal fp32
    for fmt in ALL:
        d2 = quantize(x2, fmt).dequantize()
        assert torch.isfinite(d2).all() and (d2 >= 0).all(), fmt


@pytest.mark.parametrize(
    "fmt,rule", [("mxfp4", "floor"), ("mxfp4", "ceil"), ("mxfp8", "floor"), ("mxfp8", "ceil"), ("nvfp4", "floor"), ("fp8", "floor")]
)
def test_huge_values_stay_finite(fmt, rule):
    x = torch.tensor([[3.3e38, -3.0e38] + [1.0] * 30])
    d = quantize(x, fmt, scale=rule).dequantize()
    assert torch.isfinite(d).all()
    assert d[0, 0] > 2e38 and d[0, 1] < -2e38


def test_half_precision_never_overflows_on_dequantize():
    x = torch.full((1, 32), 65504.0, dtype=torch.float16)
    d = quantize(x, "mxfp4", scale="ceil").dequantize()
    assert d.dtype == torch.float16 and torch.isfinite(d).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtype_is_kept(dtype):
    x = torch.randn(8, 64, dtype=dtype)
    for fmt in ALL:
        assert quantize(x, fmt).dequantize().dtype == dtype
    assert quantize(x, "mxfp4").dequantize(torch.float32).dtype == torch.float32


def test_empty_tensors():
    for fmt in ALL:
        assert quantize(torch.zeros(0, 32), fmt).dequantize().shape == (0, 32)
        assert quantize(torch.zeros(3, 0), fmt).dequantize().shape == (3, 0)


# ---- properties over random shapes -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(ALL),
    rows=st.integers(1, 40),
    cols=st.integers(1, 100),
    two_d=st.booleans(),
    rule=st.sampled_from(["floor", "ceil"]),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**31),
)
def test_property_shape_finite_and_bounded_error(fmt, rows, cols, two_d, rule, log_scale, seed):
    if fmt in ("nvfp4", "fp8"):
        rule = "floor"
    if fmt == "fp8":
        two_d = False
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2.0**log_scale
    q = quantize(x, fmt, block=(16, 16) if two_d else None, scale=rule)
    d = q.dequantize()
    assert d.shape == x.shape and torch.isfinite(d).all()
    # every element within 50% of its block's amax (FP4 worst case: clip 8X->6X = 25%, rounding)
    assert ((d - x).abs() <= 0.5 * x.abs().max() + 1e-30).all()
    assert (d.abs().max() <= x.abs().max() * 1.34 + 1e-30)


def test_scale_divisions_are_rounded_once():
    """s_enc = 2688 / amax and the FP8 row scale amax / 448 are single IEEE divisions
    (not reciprocal-then-multiply), so a kernel writing ``a / c`` matches bit for bit."""
    from fp4train.formats import nvfp4

    g = torch.Generator().manual_seed(9)
    for _ in range(200):
        x = torch.randn(1, 64, generator=g) * float(torch.rand(1, generator=g)) * 100
        amax = x.abs().max().double().item()
        assert nvfp4.tensor_scale(x).item() == torch.tensor(2688.0 / amax, dtype=torch.float32).item()
        assert quantize(x, "fp8").scales.item() == torch.tensor(amax / 448.0, dtype=torch.float32).item()
