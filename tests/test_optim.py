"""fp4train.optim: QAdamW (AdamW with NVFP4 moments) and its state codec."""

import io

import pytest
import torch

import fp4train
from fp4train.optim import QAdamW
from fp4train.optim import state_codec as sc


def _moments(kind: str, shape=(256, 512), steps: int = 50):
    """An AdamW first and second moment after ``steps`` gradients of ``kind``."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    t3 = torch.distributions.StudentT(3.0)
    m, v = torch.zeros(shape), torch.zeros(shape)
    for _ in range(steps):
        if kind == "gaussian":
            x = torch.randn(shape, generator=g)
        elif kind == "student_t":  # heavy tails: 3 degrees of freedom
            x = t3.sample(shape)
        else:  # rows on scales 6 decades apart
            x = torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[0])[:, None]
        m.lerp_(x, 0.1)
        v.mul_(0.999).addcmul_(x, x, value=0.001)
    return m, v


def test_codecs_round_trip_layout_and_exact_zero():
    m, v = _moments("gaussian", (32, 48))
    stored = sc.encode_signed(m)
    assert torch.equal(sc.decode_signed(stored, m.shape), fp4train.quantize(m, "nvfp4").dequantize(torch.float32))
    sv = sc.encode_second_moment(v)
    assert sv["tile_mean"].shape == (2, 3) and sv["codes"].dtype == torch.uint8
    assert sc.decode_second_moment(sv, v.shape).shape == v.shape
    z = torch.zeros(32, 48)
    assert torch.equal(sc.decode_second_moment(sc.encode_second_moment(z), z.shape), z)
    assert sc.fits((64, 32)) and sc.fits((2, 8, 32)) and not sc.fits((64,)) and not sc.fits((64, 40)) and not sc.fits((8, 32))
    assert sc.stored_bytes(sv) < v.numel() * 4 / 6  # ~4.6 bits an element against FP32's 32


@pytest.mark.parametrize("kind", ["gaussian", "student_t", "rows"])
def test_second_moment_transform_keeps_adams_update_where_direct_nvfp4_breaks_it(kind):
    """Adam's update m / (sqrt(v) + eps) from NVFP4 states: stored directly, v's small entries flush to zero and
    the update blows up (rows on different scales, heavy tails); through the transform it stays within ~15% of
    the exact update (the first moment's own NVFP4 error is most of that) and bounded like the exact one."""
    m, v = _moments(kind)
    eps = 1e-8
    exact = m / (v.sqrt() + eps)
    mq = sc.decode_signed(sc.encode_signed(m), m.shape)
    direct = mq / (fp4train.quantize(v, "nvfp4").dequantize(torch.float32).sqrt() + eps)
    ours = mq / (sc.decode_second_moment(sc.encode_second_moment(v), v.shape).sqrt() + eps)

    def rel(u):
        return float((u - exact).norm() / exact.norm())

    assert rel(ours) < 0.15 and float(ours.abs().max()) < 2 * float(exact.abs().max())
    assert rel(ours) <= rel(direct)
    if kind != "gaussian":
        assert rel(direct) > 10  # what the transform is for


def test_second_moment_floor_makes_a_tiles_small_entries_err_on_the_safe_side(monkeypatch):
    """One heavy entry in every 16x16 tile: NVFP4 cannot hold the tile's 1e-6 entries beside it. Without the floor
    on load they come back far too small and Adam's update on them grows 60x past the exact update's largest;
    with it they come back larger than they were - a smaller step, never a larger one."""
    g = torch.Generator().manual_seed(0)
    v = torch.rand(64, 64, generator=g) * 1e-6
    v[::16, ::16] = 1.0
    m = torch.randn(64, 64, generator=g) * 1e-3
    exact = (m / (v.sqrt() + 1e-8)).abs().max()

    def largest_update():
        return (m / (sc.decode_second_moment(sc.encode_second_moment(v), v.shape).sqrt() + 1e-8)).abs().max()

    assert largest_update() <= exact
    monkeypatch.setattr(sc, "FLOOR", 0.0)
    assert largest_update() > 60 * exact


def _pair(quantize_states=True, wd=0.1):
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.zeros(64))
    return [w, b], QAdamW([w, b], lr=1e-2, weight_decay=wd, quantize_states=quantize_states)


def _grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _beside_adamw(steps: int, quantize_states: bool):
    """QAdamW and torch.optim.AdamW (single-tensor) from the same start on the same gradients:
    ``(params, ref, opt)`` after ``steps`` steps."""
    params, opt = _pair(quantize_states=quantize_states)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ropt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for i in range(steps):
        for ps, o in ((params, opt), (ref, ropt)):
            _grads(ps, i)
            o.step()
    return params, ref, opt


def test_unquantized_states_are_torch_adamw_bit_for_bit():
    params, ref, _ = _beside_adamw(6, quantize_states=False)
    assert all(torch.equal(a, b) for a, b in zip(params, ref))


def test_quantized_states_are_stored_small_and_track_adamw():
    params, ref, opt = _beside_adamw(20, quantize_states=True)
    w, b = params
    assert set(opt.state[w]) >= {"exp_avg.codes", "exp_avg_sq.tile_mean", "step"} and set(opt.state[b]) == {"exp_avg", "exp_avg_sq", "step"}
    fp32 = sum(2 * p.numel() * 4 for p in params)
    assert opt.state_bytes() < fp32 / 4  # the 64-element bias stays FP32
    start = _pair()[0][0].detach()
    gap = float((w.detach() - ref[0].detach()).norm() / (ref[0].detach() - start).norm())
    assert gap < 0.2, gap  # pure-noise gradients: the same walk within 20% of the distance AdamW moved
    assert torch.equal(b, ref[1])  # FP32 states: AdamW's own bits


def test_qadamw_fits_a_regression_as_adamw_does():
    """A least-squares fit (64 x 128 weights, 300 steps): QAdamW ends within 5% of AdamW's loss, far below the start."""
    g = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(512, 128, generator=g), torch.randn(64, 128, generator=g) / 8
    y = x @ w_true.T + 0.01 * torch.randn(512, 64, generator=g)

    def fit(make):
        w = torch.nn.Parameter(torch.zeros(64, 128))
        opt = make([w])
        for _ in range(300):
            loss = (x @ w.T - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float((x @ w.T - y).square().mean())

    start = float(y.square().mean())
    adamw = fit(lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.0, foreach=False))
    qadamw = fit(lambda ps: QAdamW(ps, lr=3e-2, weight_decay=0.0))
    assert adamw < 0.01 * start and qadamw < 1.05 * adamw + 1e-4, (start, adamw, qadamw)


def test_state_dict_resumes_bit_for_bit_through_weights_only_load():
    params, opt = _pair()
    for i in range(3):
        _grads(params, i)
        opt.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
    for i in range(3, 6):
        _grads(params, i)
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(t) for t in saved["params"]]
    opt2 = QAdamW(params2, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(saved["opt"])
    for i in range(3, 6):
        _grads(params2, i)
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params, params2))


def test_compiled_update_tracks_the_eager_one_and_compiles_once_per_shape():
    """compiled=True: the same update fused by torch.compile (equal up to float rounding of fused operations),
    compiled once per state shape however the learning rate moves (its scalars go in as tensors)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    shapes = [(64, 128), (32, 64), (64,)]
    eager = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    opts = [QAdamW(ps, lr=1e-2, weight_decay=0.1, compiled=c) for ps, c in ((eager, False), (fused, True))]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: (s + 1) / 5) for o in opts]
    for i in range(5):
        for ps in (eager, fused):
            _grads(ps, i)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    for a, b in zip(eager, fused):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), float((a - b).abs().max())
    assert counters["stats"]["unique_graphs"] == 2  # two quantized shapes; the bias keeps FP32 states, uncompiled
    state = opts[1].state[fused[0]]
    assert state["exp_avg.codes"].dtype == opts[0].state[eager[0]]["exp_avg.codes"].dtype


def test_bad_hyperparameters_and_sparse_gradients_are_refused():
    w = torch.nn.Parameter(torch.randn(16, 16))
    with pytest.raises(ValueError, match="betas must be in"):
        QAdamW([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr, eps and weight_decay must be >= 0"):
        QAdamW([w], lr=-1.0)
    w.grad = torch.randn(16, 16).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        QAdamW([w]).step()


def test_newton_schulz_in_bf16_is_torch_muons_and_nvfp4_needs_its_own_coefficients():
    """matmul="bf16" is torch.optim.Muon's iteration bit for bit (either orientation). With NVFP4 products Muon's
    coefficients blow the iteration up; NVFP4_COEFFICIENTS keep it bounded, nearer the orthogonal factor."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, NVFP4_COEFFICIENTS, newton_schulz

    g = torch.Generator().manual_seed(0)
    for shape in ((64, 128), (128, 64)):
        x = torch.randn(shape, generator=g)
        assert torch.equal(newton_schulz(x), _zeropower_via_newtonschulz(x, BF16_COEFFICIENTS, 5, 1e-7))
    x = torch.randn(128, 512, generator=g)
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh

    def dist(y):
        return float((y.double() - polar).norm() / polar.norm())

    ours = newton_schulz(x, NVFP4_COEFFICIENTS, matmul="nvfp4")
    assert torch.isfinite(ours).all() and dist(ours) < 1.0
    assert not dist(newton_schulz(x, BF16_COEFFICIENTS, matmul="nvfp4")) < 10 * dist(ours)
    with pytest.raises(ValueError, match="multiple of 16"):
        newton_schulz(torch.randn(20, 64), matmul="nvfp4")
    with pytest.raises(ValueError, match="2D matrix"):
        newton_schulz(torch.randn(4, 4, 4))


def _muon_pair(**kw):
    from fp4train.optim import QMuon

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(64, 32, generator=g), torch.randn(32, generator=g)
    params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    opt = QMuon([{"params": [params[0]], "muon": True}, {"params": [params[1]]}], lr=1e-2, **kw)
    return params, opt


def _muon_grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_qmuon_without_quantized_states_is_torch_muon_and_adamw_bit_for_bit():
    params, opt = _muon_pair(quantize_states=False, adjust_lr_fn="original")
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    muon = torch.optim.Muon([ref[0]], lr=1e-2, weight_decay=0.1, adjust_lr_fn="original")
    adamw = torch.optim.AdamW([ref[1]], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for i in range(4):
        _muon_grads(params, i)
        _muon_grads(ref, i)
        opt.step(), muon.step(), adamw.step()
    assert torch.equal(params[0], ref[0]) and torch.equal(params[1], ref[1])


def test_qmuon_stores_momentum_in_nvfp4_and_tracks_muon():
    params, opt = _muon_pair()
    exact, ref = _muon_pair(quantize_states=False)
    for i in range(6):
        _muon_grads(params, i)
        _muon_grads(exact, i)
        opt.step(), ref.step()
    st = opt.state[params[0]]
    assert st["momentum_buffer.codes"].dtype == torch.uint8
    fp32_bytes = params[0].numel() * 4
    assert sum(t.numel() * t.element_size() for t in st.values()) < fp32_bytes / 3.5
    moved = params[0] - exact[0]  # the two runs' weights differ only by the momentum's quantization
    start = _muon_pair()[0][0]
    assert (moved.norm() / (exact[0] - start).norm()) < 0.25


def test_qmuon_nvfp4_newton_schulz_trains_and_bad_settings_are_refused():
    from fp4train.optim import QMuon

    params, opt = _muon_pair(ns_matmul="nvfp4")
    assert opt.param_groups[0]["ns_coefficients"] == (3.0, -4.775, 2.3)
    for i in range(3):
        _muon_grads(params, i)
        opt.step()
    assert torch.isfinite(params[0]).all()
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="2D weights only"):
        QMuon([{"params": [w], "muon": True}])
    with pytest.raises(ValueError, match="ns_matmul"):
        QMuon([w], ns_matmul="fp8")
