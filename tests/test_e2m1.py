"""E2M1 element codec: the whole truth table."""

import pytest
import torch

from fp4train.formats import e2m1

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_every_grid_point_encodes_to_its_code_and_back():
    for code, g in enumerate(GRID):
        for sign in (1.0, -1.0):
            v = torch.tensor([sign * g])
            c = e2m1.encode_nearest(v)
            assert c.item() == code | (8 if sign < 0 else 0)
            assert e2m1.decode(c).item() == sign * g


# midpoint -> the neighbour whose code is even (mantissa bit 0)
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("mid,expected", TIES)
def test_midpoint_ties_go_to_even(mid, expected):
    for sign in (1.0, -1.0):
        c = e2m1.encode_nearest(torch.tensor([sign * mid]))
        assert e2m1.decode(c).item() == sign * expected
        assert (c.item() & 1) == 0  # the even code


def test_values_next_to_midpoints_round_to_the_nearer_point():
    for (mid, _), lo, hi in zip(TIES, GRID[:-1], GRID[1:]):
        below = torch.nextafter(torch.tensor([mid]), torch.tensor([-1.0]))
        above = torch.nextafter(torch.tensor([mid]), torch.tensor([10.0]))
        assert e2m1.decode(e2m1.encode_nearest(below)).item() == lo
        assert e2m1.decode(e2m1.encode_nearest(above)).item() == hi


def test_saturation_above_six():
    v = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, -1e30])
    assert e2m1.decode(e2m1.encode_nearest(v)).tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, -6.0]
    assert e2m1.decode(e2m1.encode_stochastic(v, torch.zeros(6))).tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, -6.0]


def test_signed_zero():
    c = e2m1.encode_nearest(torch.tensor([0.0, -0.0, -0.1, 0.1]))
    assert c.tolist() == [0, 8, 8, 0]
    d = e2m1.decode(c)
    assert d.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.signbit(d).tolist() == [False, True, True, False]


def test_nearest_is_the_closest_grid_point_everywhere():
    v = torch.linspace(-7, 7, 20001)
    q = e2m1.decode(e2m1.encode_nearest(v))
    grid = torch.tensor(GRID + [-g for g in GRID])
    best = (v[:, None] - grid[None]).abs().min(1).values
    assert torch.equal((v - q).abs(), best.where(v.abs() <= 6, (v.abs() - 6)))


def test_pack_unpack_roundtrip_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3).reshape(2, 24)
    packed = e2m1.pack(codes)
    assert packed.shape == (2, 12) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == 0x10  # element 0 low nibble, element 1 high nibble
    assert torch.equal(e2m1.unpack(packed), codes)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even last dimension"):
        e2m1.pack(torch.zeros(3, dtype=torch.uint8))


def test_decode_under_successive_fake_tensor_modes_and_then_on_real_tensors():
    """A compiled layer's shape propagation decodes fake tensors; nothing made there may reach the next trace, which
    refuses another mode's fake tensor ("Mixing fake modes": a Full-Stack FP4 run compiled on a GPU, whose eager
    path never decodes on the host)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for _ in range(2):  # two traces, two fake modes
        with FakeTensorMode() as mode:
            codes = mode.from_tensor(torch.arange(16, dtype=torch.uint8))
            assert e2m1.decode(codes).shape == (16,)
    assert e2m1.decode(torch.arange(16, dtype=torch.uint8)).tolist()[:8] == list(e2m1.E2M1_GRID)


def test_grid_is_the_documented_magnitudes_exactly():
    assert e2m1._grid(torch.zeros(1)).tolist() == list(e2m1.E2M1_GRID)
