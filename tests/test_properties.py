"""Property-based tests of every quantizer: invariants that hold for any input.

Inputs are drawn by hypothesis over shapes that are not whole blocks, float32 and bfloat16, and
values that mix ordinary numbers with NaN, +-Inf, subnormals, zeros (whole zero blocks too) and
huge magnitudes. For every format x geometry x scale rule x rounding:

* the result has the input's shape and dtype;
* a block that holds NaN/Inf dequantizes to all-NaN, and a finite block never becomes non-finite;
* an all-zero block dequantizes to exact zeros;
* quantization is odd: q(-x) = -q(x) (stochastic rounding too, with the same seed);
* it commutes with powers of two: q(2^k x) = 2^k q(x), inside the formats' exponent range;
* with nearest rounding, MX formats are projections (q(q(x)) = q(x)) and their error per block is
  bounded by a fixed fraction of the block maximum.
"""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fp4train import quantize

# (format, geometry: None = along the last dim, 0 = along dim 0, (b, b) = 2D tiles, scale rule)
CASES = [
    ("mxfp4", None, "floor"), ("mxfp4", None, "ceil"), ("mxfp4", 0, "floor"), ("mxfp4", (32, 32), "ceil"),
    ("mxfp8", None, "floor"), ("mxfp8", None, "ceil"),
    ("nvfp4", None, "floor"), ("nvfp4", 0, "floor"), ("nvfp4", (16, 16), "floor"),
    ("fp8", None, "floor"),
]
BLOCK = {"mxfp4": 32, "mxfp8": 32, "nvfp4": 16}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -3e-39, 1.5e-45, 3e38, -1e30]


@st.composite
def tensors(draw, special=True):
    rows = draw(st.integers(1, 40))
    cols = draw(st.integers(1, 70))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())
    if special:
        n = draw(st.integers(0, 6))
        for _ in range(n):
            r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
            x[r, c] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # a run of zeros: whole zero blocks at some geometries
        r = draw(st.integers(0, rows - 1))
        x[r, : draw(st.integers(1, cols))] = 0.0
    return x.to(dtype)


def _q(x, fmt, geom, scale, rounding="nearest", seed=7):
    kw = {"scale": scale, "rounding": rounding, "seed": seed if rounding == "stochastic" else None}
    if isinstance(geom, tuple):
        kw["block"] = geom
    elif geom == 0:
        kw["axis"] = 0
    return quantize(x, fmt, **kw).dequantize()


def _block_ids(shape, fmt, geom):
    """Each element's block number (the elements that share one scale)."""
    rows, cols = shape
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    if fmt == "fp8":
        return r.clone()
    if isinstance(geom, tuple):
        b = geom[0]
        return (r // b) * (cols // b + 1) + c // b
    b = BLOCK[fmt]
    if geom == 0:
        return (r // b) * cols + c
    return r * (cols // b + 1) + c // b


def _block_max(values, ids):
    """Each block's maximum of ``values`` (float32, no NaN), broadcast back to every element."""
    flat, idx = values.flatten(), ids.flatten()
    out = torch.zeros(int(idx.max()) + 1).scatter_reduce(0, idx, flat, reduce="amax", include_self=False)
    return out[idx].reshape(values.shape)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt,geom,scale", CASES)
@SETTINGS
@given(x=tensors())
def test_shape_dtype_and_non_finite_blocks(fmt, geom, scale, rounding, x):
    y = _q(x, fmt, geom, scale, rounding)
    assert y.shape == x.shape and y.dtype == x.dtype
    ids = _block_ids(tuple(x.shape), fmt, geom)
    xf = x.float()
    bad = _block_max((~torch.isfinite(xf)).float(), ids).bool()
    yf = y.float()
    assert torch.isnan(yf[bad]).all()  # NaN/Inf anywhere in a block: the whole block is NaN
    assert torch.isfinite(yf[~bad]).all()  # and nothing finite ever becomes NaN or Inf
    zero = _block_max(xf.abs().nan_to_num(1.0), ids) == 0
    assert (yf[zero] == 0).all()  # all-zero blocks stay exact zeros


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt,geom,scale", CASES)
@SETTINGS
@given(x=tensors())
def test_quantization_is_odd(fmt, geom, scale, rounding, x):
    y, y_neg = _q(x, fmt, geom, scale, rounding), _q(-x, fmt, geom, scale, rounding)
    torch.testing.assert_close(y_neg, -y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt,geom,scale", CASES)
@SETTINGS
@given(x=tensors(special=False), k=st.integers(-8, 8))
def test_quantization_commutes_with_powers_of_two(fmt, geom, scale, rounding, x, k):
    x = x.float()
    x = torch.where(x.abs() < 2.0**-40, torch.zeros_like(x), x)  # inside every format's exponent range at 2^k
    y, y_k = _q(x, fmt, geom, scale, rounding), _q(x * 2.0**k, fmt, geom, scale, rounding)
    torch.testing.assert_close(y_k, y * 2.0**k, rtol=0, atol=0)


MX = [c for c in CASES if c[0] in ("mxfp4", "mxfp8")]
# |q(x) - x| <= ERR * block max with nearest rounding (the element grid's largest relative half-gap,
# or the clipping of floor scales, whichever is larger), for blocks above the E8M0 scale's floor
ERR = {("mxfp4", "floor"): 1 / 2, ("mxfp4", "ceil"): 1 / 3, ("mxfp8", "floor"): 1 / 4, ("mxfp8", "ceil"): 1 / 14}


@pytest.mark.parametrize("fmt,geom,scale", MX)
@SETTINGS
@given(x=tensors())
def test_mx_nearest_is_a_projection_with_bounded_error(fmt, geom, scale, x):
    y = _q(x, fmt, geom, scale)
    torch.testing.assert_close(_q(y, fmt, geom, scale), y, rtol=0, atol=0, equal_nan=True)
    xf, yf = x.float(), y.float()
    ids = _block_ids(tuple(x.shape), fmt, geom)
    amax = _block_max(xf.abs().nan_to_num(float("inf")), ids)
    live = torch.isfinite(amax) & (amax > 2.0**-110) & (amax < 2.0**126)
    assume(bool(live.any()))
    err = (yf - xf).abs()
    bound = ERR[(fmt, scale)] * amax
    if x.dtype == torch.bfloat16:  # the dequantized value is rounded back to bfloat16 (8 bits)
        bound = bound + yf.abs() * 2.0**-8
    assert (err[live] <= bound[live] * (1 + 1e-6)).all(), float((err - bound)[live].max())


def test_property_strategies_reach_the_edge_cases():
    """The drawn inputs do hold what the module docstring promises (so the properties are tested on it)."""
    seen = {"nan": False, "inf": False, "subnormal": False, "bf16": False, "ragged": False}

    @settings(max_examples=200, deadline=None, database=None)
    @given(x=tensors())
    def probe(x):
        xf = x.float()
        seen["nan"] |= bool(torch.isnan(xf).any())
        seen["inf"] |= bool(torch.isinf(xf).any())
        seen["subnormal"] |= bool(((xf != 0) & (xf.abs() < torch.finfo(torch.float32).tiny)).any())
        seen["bf16"] |= x.dtype == torch.bfloat16
        seen["ragged"] |= x.shape[-1] % 32 != 0 and x.shape[0] % 16 != 0

    probe()
    assert all(seen.values()), seen
