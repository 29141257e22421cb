"""Stochastic rounding: unbiased, at most one grid step, reproducible from a seed."""

import pytest
import torch

from fp4train import counter_rng, device_seeds, quantize
from fp4train.formats import e4m3

N_DRAWS = 1000


def _draws(x, fmt, n=N_DRAWS, **kw):
    return torch.stack([quantize(x, fmt, rounding="stochastic", seed=s, **kw).dequantize() for s in range(n)])




E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3 = e4m3.decode(torch.arange(0, 127, dtype=torch.uint8))  # all finite magnitudes, ascending


def _scaled(x, q):
    """x in element units (the value the element rounding sees) and the per-element scale."""
    if q.fmt == "nvfp4":  # documented order: (x * s_enc) / sb
        sb = e4m3.decode(q.scales).repeat_interleave(16, -1)
        return (x * q.tensor_scale) / sb, sb / q.tensor_scale
    s = q.scale_values()
    s = s.expand(*s.shape[:-1], x.shape[-1]) if q.fmt == "fp8" else s.repeat_interleave(q.layout.block[0], -1)
    return x / s, s


def _brackets(v, fmt):
    """The representable magnitudes just below and above |v|."""
    grid = E2M1 if fmt in ("mxfp4", "nvfp4") else E4M3
    a = v.abs().clamp(max=grid[-1])
    i = (torch.bucketize(a, grid, right=True) - 1).clamp(0, len(grid) - 1)
    lo = grid[i]
    hi = torch.where(lo == a, lo, grid[(i + 1).clamp(max=len(grid) - 1)])
    return lo, hi


CASES = [("mxfp4", dict(scale="ceil")), ("nvfp4", {}), ("mxfp8", dict(scale="ceil")), ("fp8", {})]


@pytest.mark.parametrize("fmt,kw", CASES)
def test_never_more_than_one_grid_step_from_nearest(fmt, kw):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g)
    q0 = quantize(x, fmt, **kw)
    q1 = quantize(x, fmt, rounding="stochastic", seed=0, **kw)
    _assert_sr_scales(x, q0, q1)
    v, _ = _scaled(x, q1)
    lo, hi = _brackets(v, fmt)
    for s in range(64):
        q = quantize(x, fmt, rounding="stochastic", seed=s, **kw)
        assert torch.equal(q.scales, q1.scales)  # scales do not depend on the seed
        e = q.element_values().abs()
        assert ((e == lo) | (e == hi)).all()
    v0, _ = _scaled(x, q0)
    lo0, hi0 = _brackets(v0, fmt)
    e0 = q0.element_values().abs()
    assert ((e0 == lo0) | (e0 == hi0)).all()  # RTNE picks one of its two neighbours


def _assert_sr_scales(x, near, sr):
    """SR keeps the nearest-rounding scales, except NVFP4's blocks whose nearest E4M3 scale maps the block
    maximum past 6: exactly those take the next scale up (one code)."""
    if near.fmt != "nvfp4":
        assert torch.equal(sr.scales, near.scales)
        return
    v0, _ = _scaled(x, near)
    over = v0.abs().reshape(*near.scales.shape, 16).amax(-1) > 6.0
    assert over.any(), "the input should hold blocks whose nearest scale saturates"
    assert torch.equal(sr.scales.int(), near.scales.int() + over.int())


@pytest.mark.parametrize("fmt,kw", CASES)
def test_unbiased_mean_within_sampling_bound(fmt, kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    q0 = quantize(x, fmt, **kw)
    v, scale = _scaled(x, quantize(x, fmt, rounding="stochastic", seed=0, **kw))
    lo, hi = _brackets(v, fmt)
    step = (hi - lo) * scale  # the two possible outcomes are `step` apart
    draws = _draws(x, fmt, **kw)
    # A two-point draw has variance <= step^2 / 4, so the mean of N_DRAWS has standard
    # deviation <= step / (2 sqrt(N)). Allow 5 sigma (over 512 elements P(fail) ~ 3e-4),
    # plus FP32 rounding of the dequantized values.
    bound = 5 * step / (2 * N_DRAWS**0.5) + 1e-6 * x.abs()
    err = (draws.mean(0) - x).abs()
    # SR is unbiased inside the grid, and under SR every scale keeps every element inside it (ceil
    # scales; NVFP4 takes the next E4M3 block scale where the nearest one would saturate)
    assert (v.abs() <= (6.0 if fmt in ("mxfp4", "nvfp4") else 448.0)).all()
    assert (err <= bound).all()
    # nearest rounding *is* biased on the same inputs: the bound can tell them apart
    near = q0.dequantize()
    assert ((near - x).abs() > bound).float().mean() > 0.5


def _scale_rounds_down_blocks(n_blocks=63, frac=0.06, seed=0):
    """A tensor whose first block holds its amax (so ``s_enc = 2688 / amax``) and whose other blocks have a
    maximum with ``(amax_b / 6) * s_enc = 1 + frac``: E4M3's nearest value there is 1.0, so the nearest block
    scale rounds down and maps the block maximum to ``6 * (1 + frac)``, past E2M1's 6."""
    g = torch.Generator().manual_seed(seed)
    amax = 448.0
    x = (torch.rand(n_blocks + 1, 16, generator=g) * 2 - 1)
    x[0, 0] = amax
    amax_b = (1 + frac) * 6 * amax / 2688
    x[1:] = x[1:] * amax_b * 0.9
    x[1:, 3] = torch.where(torch.rand(n_blocks, generator=g) < 0.5, -amax_b, amax_b)  # the block maxima, either sign
    return x.reshape(-1, 64)


def test_nvfp4_stochastic_rounding_is_unbiased_where_the_block_scale_rounds_down():
    """Blocks whose nearest E4M3 scale would saturate their maximum: under SR the mean of many draws is the
    input (the maxima included), where saturating at 6 would bias each maximum by frac / (1 + frac) ~ 5.7%."""
    x = _scale_rounds_down_blocks()
    near = quantize(x, "nvfp4")
    v0, _ = _scaled(x, near)
    maxima = v0.abs() > 6.0
    assert maxima.sum() == 63  # every block but the first saturates under the nearest scale
    n = 2000
    mean = torch.stack([quantize(x, "nvfp4", rounding="stochastic", seed=s).dequantize() for s in range(n)]).mean(0)
    q1 = quantize(x, "nvfp4", rounding="stochastic", seed=0)
    v, scale = _scaled(x, q1)
    assert (v.abs() <= 6.0).all()
    lo, hi = _brackets(v, "nvfp4")
    bound = 5 * (hi - lo) * scale / (2 * n**0.5) + 1e-6 * x.abs()
    assert ((mean - x).abs() <= bound).all()
    rel = ((mean - x) / x)[maxima]
    assert rel.abs().max() < 0.02 and abs(rel.mean()) < 0.005  # saturation would give -0.057 on every maximum


def test_grid_values_are_never_moved():
    x = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4])
    for s in range(20):
        assert torch.equal(quantize(x, "mxfp4", rounding="stochastic", seed=s).dequantize(), x)


def test_reproducible_from_a_seed_and_different_across_seeds():
    x = torch.randn(32, 64)
    a = quantize(x, "mxfp4", rounding="stochastic", seed=123)
    b = quantize(x, "mxfp4", rounding="stochastic", seed=123)
    c = quantize(x, "mxfp4", rounding="stochastic", seed=124)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.codes, c.codes)


def test_seed_none_follows_torch_manual_seed():
    x = torch.randn(32, 64)
    torch.manual_seed(7)
    a = quantize(x, "nvfp4", rounding="stochastic").codes
    torch.manual_seed(7)
    b = quantize(x, "nvfp4", rounding="stochastic").codes
    assert torch.equal(a, b)


def test_counter_uniforms_are_uniform():
    u = counter_rng.uniform(42, (200_000,))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 15 dof: P(chi2 > 50) ~ 1e-5
    # neighbouring counters are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01


def test_mul32_matches_python_integers():
    x = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    got = counter_rng._mul32(x, 0x846CA68B)
    assert got.tolist() == [(v * 0x846CA68B) % 2**32 for v in x.tolist()]


def test_host_seed_mixing_matches_the_tensor_hash():
    x = torch.randint(0, 2**32, (200,), dtype=torch.int64)
    assert counter_rng.lowbias32(x).tolist() == [counter_rng._lowbias32_int(v) for v in x.tolist()]
    seeds = {counter_rng.derive_seed(7, g, o) for g in range(3) for o in range(3)}
    assert len(seeds) == 9 and all(0 <= s < 2**62 for s in seeds)


def test_seed_derivation_on_tensors_matches_the_host_ints():
    """derive_seed_tensor / seed_keys_tensor (a seed kept on a device, derived there) give derive_seed's and
    seed_keys' values bit for bit, for salts given as ints or as tensors, at the ends of the 62-bit range too."""
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**62, (64,), generator=g, dtype=torch.int64).tolist() + [0, 1, 2**32 - 1, 2**32, 2**62 - 1]
    for s in seeds:
        t = torch.tensor(s, dtype=torch.int64)
        for salt in ((), (0,), (1, 2), (3, 0), (2**40 + 7,)):
            want = counter_rng.derive_seed(s, *salt)
            assert counter_rng.derive_seed_tensor(t, *salt).item() == want, (s, salt)
            assert counter_rng.derive_seed_tensor(t, *(torch.tensor(v) for v in salt)).item() == want, (s, salt)
        assert counter_rng.seed_keys_tensor(t).tolist() == list(counter_rng.seed_keys(s)), s


def test_device_seed_stream_draws_fresh_reproducible_seeds_and_restores_its_state():
    """Call n of a stream is derive_seed(base, n), made on the stream's device; base follows torch.manual_seed;
    a saved state continues the same sequence."""
    torch.manual_seed(3)
    s = device_seeds.DeviceSeedStream("cpu")
    torch.manual_seed(3)
    assert s.base == counter_rng.fresh_seed()
    got = [s.next().item() for _ in range(4)]
    assert got == [counter_rng.derive_seed(s.base, n) for n in (1, 2, 3, 4)] and len(set(got)) == 4
    st = s.state_dict()
    after = [s.next().item() for _ in range(3)]
    t = device_seeds.DeviceSeedStream("cpu", base=1)
    t.load_state_dict(st)
    assert [t.next().item() for _ in range(3)] == after


def test_a_restarted_stream_does_not_depend_on_what_ran_before(monkeypatch):
    """restart_device_seed_stream draws one base from the CPU generator whether the process made the stream
    before or not (a run's seeds must not depend on the process's history), and keeps an existing stream's tensors."""
    monkeypatch.setattr(device_seeds, "_STREAMS", {})
    torch.manual_seed(11)
    fresh = device_seeds.restart_device_seed_stream("cpu")
    first = (fresh.base, [fresh.next().item() for _ in range(2)])
    count = fresh.count
    torch.manual_seed(11)
    again = device_seeds.restart_device_seed_stream("cpu")
    assert again is fresh and again.count is count and (again.base, [again.next().item() for _ in range(2)]) == first


def test_random_signs_from_a_seeds_keys_equal_the_seeds_signs():
    """A random Hadamard transform whose seed lives on a device takes the seed's keys (an int64 tensor): the same
    signs, and so the same transform, as the int seed (what lets nvfp4's layers draw on the device in CUDA graphs)."""
    from fp4train.transforms.hadamard import hadamard, signs

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for s in (0, 1, 12345, 2**40 + 3, 2**62 - 1):
        # the signs themselves: bit 31 of the element index's hash
        assert torch.equal(counter_rng.random_signs(s, 64), 1.0 - 2.0 * (counter_rng.hash32(s, torch.arange(64)) >> 31).float())
        keys = counter_rng.seed_keys_tensor(torch.tensor(s, dtype=torch.int64))
        assert torch.equal(counter_rng.random_signs_keys(keys, 64), counter_rng.random_signs(s, 64))
        assert torch.equal(signs(keys, 16), signs(s, 16))
        assert torch.equal(hadamard(x, 16, seed=keys), hadamard(x, 16, seed=s))
    derived = counter_rng.derived_keys_tensor(torch.tensor(77, dtype=torch.int64), 2, 2)
    assert torch.equal(signs(derived, 16), signs(counter_rng.derive_seed(77, 2, 2), 16))
    assert torch.equal(device_seeds.derived_keys(torch.tensor(77, dtype=torch.int64), 2, 2), derived)  # the kernel (interpreted)


def test_four_over_six_under_stochastic_rounding_chooses_per_block_from_the_input_and_stays_unbiased():
    """4/6 picks each block's scale (max to 6 or to 4) from the block alone: the scales are the same for every
    seed, and the mean of many SR draws is the input within the sampling noise (chosen on the draw, the mean of
    400 draws of this input missed it by 2.4x the noise). 4/6 still lowers the round-to-nearest error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    n = 400
    qs = [quantize(x, "nvfp4", rounding="stochastic", seed=s, four_over_six=True) for s in range(n)]
    assert all(torch.equal(q.scales, qs[0].scales) for q in qs)
    draws = torch.stack([q.dequantize() for q in qs]).double()
    miss = (draws.mean(0) - x.double()).square().sum()
    noise = draws.var(0).sum() / n  # E||mean - x||^2 of an unbiased rounding
    assert miss < 1.5 * noise, f"mean of the draws misses the input by {float((miss / noise) ** 0.5):.2f}x the noise"
    near6, near46 = quantize(x, "nvfp4").dequantize(), quantize(x, "nvfp4", four_over_six=True).dequantize()
    assert (near46 - x).square().sum() < (near6 - x).square().sum()
