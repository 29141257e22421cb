"""E4M3 codec used by MXFP8, FP8 rowwise and NVFP4's block scales."""

import pytest
import torch

from fp4train.formats import e4m3


def test_every_finite_code_roundtrips():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    v = e4m3.decode(codes)
    assert torch.equal(e4m3.encode(v), codes)


def test_largest_and_smallest():
    assert e4m3.decode(torch.tensor([0x7E], dtype=torch.uint8)).item() == 448.0
    assert e4m3.decode(torch.tensor([0x01], dtype=torch.uint8)).item() == 2.0**-9


def test_ties_to_even_and_saturation():
    v = torch.tensor([17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 460.0, 1e6, -1e6])
    assert e4m3.round_to_e4m3(v).tolist() == [16.0, 20.0, 0.0, 2.0**-8, 448.0, 448.0, -448.0]


def test_nan_and_inf_become_nan_not_448():
    c = e4m3.encode(torch.tensor([float("nan"), float("inf"), -float("inf")]))
    assert torch.isnan(e4m3.decode(c)).all()
    c = e4m3.encode_stochastic(torch.tensor([float("nan"), float("inf")]), torch.zeros(2))
    assert torch.isnan(e4m3.decode(c)).all()


def test_stochastic_rounds_between_neighbours_unbiased():
    v = torch.full((200_000,), 17.5)  # neighbours 16 and 18
    u = torch.rand(v.shape, generator=torch.Generator().manual_seed(0))
    q = e4m3.decode(e4m3.encode_stochastic(v, u))
    assert set(q.unique().tolist()) == {16.0, 18.0}
    # P(18) = 0.75; std of the mean = 2 * sqrt(.75 * .25 / n)
    assert abs(q.mean().item() - 17.5) < 5 * 2 * (0.1875 / v.numel()) ** 0.5


def test_field_arithmetic_gives_the_byte_view_bits_and_runs_under_vmap():
    """Compiled code encodes and decodes through the fields (a dtype view has no vmap rule before torch 2.13): every
    code, every value, every tie between neighbours, zeros of both signs and saturation give the view's bits."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    by_view = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(torch.nan_to_num(e4m3.decode_fields(codes), 1e9), torch.nan_to_num(by_view, 1e9))
    assert torch.equal(e4m3.decode_fields(codes).signbit(), by_view.signbit())
    grid = by_view[torch.isfinite(by_view)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    v = torch.cat([grid, ties, ties.nextafter(ties + 1), ties.nextafter(ties - 1), torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-30]),
                   torch.randn(100_000, generator=g) * torch.logspace(-4, 3, 100_000)])
    rounded = v.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(e4m3.encode_fields(rounded.to(torch.float32)), rounded.view(torch.uint8))
    batched = torch.vmap(lambda x: e4m3.decode_fields(e4m3.encode_fields(x)))(grid[None].expand(3, -1))
    assert torch.equal(batched, grid[None].expand(3, -1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here; run on the device")
def test_compiled_codec_on_the_gpu_gives_the_eager_bits():
    """Inductor's GPU code for the field arithmetic against the eager byte view: every code, ties, 200k values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    grid = e4m3.decode(codes)
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.cat([grid, ties, ties.nextafter(ties + 1), ties.nextafter(ties - 1),
                   torch.randn(200_000, generator=g, device="cuda") * torch.logspace(-5, 3, 200_000, device="cuda"),
                   torch.tensor([float("nan"), float("inf"), -0.0], device="cuda")])
    assert torch.equal(torch.compile(e4m3.encode)(v), e4m3.encode(v))
    assert torch.equal(torch.compile(e4m3.decode)(codes).nan_to_num(1e9), e4m3.decode(codes).nan_to_num(1e9))
