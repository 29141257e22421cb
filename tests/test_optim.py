"""fp4train.optim: QAdamW (AdamW with NVFP4 moments) and its state codec."""

import io
import statistics
from pathlib import Path

import pytest
import torch

import fp4train
from fp4train.optim import QAdamW
from fp4train.optim import state_codec as sc

ROOT = Path(__file__).resolve().parent.parent


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


def _grads(params, i, scales=None):
    g = torch.Generator().manual_seed(100 + i)
    for j, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g) * (1 if scales is None else scales[j])


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


def _eager_beside_compiled(make, eager, fused, steps: int = 5, scales=None):
    """``make(params, compiled)`` over ``eager`` (compiled=False) and ``fused`` (True), stepped ``steps`` times on the
    same gradients (each parameter's times its entry of ``scales``) with a moving learning rate; returns both
    optimizers."""
    opts = [make(eager, False), make(fused, True)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: (s + 1) / 5) for o in opts]
    for i in range(steps):
        for ps in (eager, fused):
            _grads(ps, i, scales)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    return opts


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_compiled_update_tracks_the_eager_one_and_compiles_once_per_shape(multi_tensor):
    """compiled=True: the same update fused by torch.compile (equal up to float rounding of fused operations),
    compiled once per state shape however the learning rate moves (its scalars go in as tensors); with
    multi_tensor, one call for the parameters of a shape."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    shapes = [(64, 128), (32, 64), (64,), (64, 128)]  # two of a shape: updated by one call
    eager = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    opts = _eager_beside_compiled(lambda ps, c: QAdamW(ps, lr=1e-2, weight_decay=0.1, compiled=c, multi_tensor=c and multi_tensor),
                                  eager, fused, scales=[1, 1, 1, 100])  # two of a shape, far apart: each its own scales
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


def test_newton_schulz_in_bf16_is_torch_muons():
    """matmul="bf16" is torch.optim.Muon's iteration bit for bit (either orientation)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, newton_schulz

    g = torch.Generator().manual_seed(0)
    for shape in ((64, 128), (128, 64)):
        x = torch.randn(shape, generator=g)
        assert torch.equal(newton_schulz(x), _zeropower_via_newtonschulz(x, BF16_COEFFICIENTS, 5, 1e-7))
    # NVFP4 products of a matrix whose dims are not whole blocks (a router's [experts, dim]): padded with zeros, which
    # stay zero, and cut off again
    from fp4train.optim.ns_coefficients import nvfp4_coefficients

    for shape in ((4, 128), (20, 72), (72, 20)):
        x = torch.randn(shape, generator=g)
        y = newton_schulz(x, nvfp4_coefficients(*shape), 5, matmul="nvfp4")
        u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
        assert y.shape == x.shape and torch.isfinite(y).all() and float(torch.linalg.matrix_norm(y, ord=2)) < 1.5
        assert float((y.double() - u @ vh).norm() / (u @ vh).norm()) < 0.6
    with pytest.raises(ValueError, match="2D matrix"):
        newton_schulz(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="one per step"):
        newton_schulz(torch.randn(16, 32), ((1.0, 0.0, 0.0),) * 4, 5, matmul="nvfp4")


def test_the_nvfp4_coefficient_table_is_the_committed_fit_and_covers_every_presets_aspect_ratio():
    """NVFP4_TABLE is what bench/ns_coefficients.py fitted (its results file), and every hidden-matrix shape of the
    presets has an entry of its own aspect ratio."""
    import json

    from fp4train.models import PRESETS
    from fp4train.optim.ns_coefficients import NVFP4_TABLE

    fitted = json.loads((ROOT / "bench/results/ns_coefficients.json").read_text())["results"]
    assert {tuple(r["shape"]): tuple(tuple(c) for c in r["coefficients"]) for r in fitted} == NVFP4_TABLE
    ratios = {round(k[1] / k[0], 2) for k in NVFP4_TABLE}
    for c in PRESETS.values():
        kv = c.dim // c.n_heads * c.n_kv_heads
        for m, n in ((c.dim, c.dim), (kv, c.dim), (c.ffn_dim, c.dim)):
            assert round(max(m, n) / min(m, n), 2) in ratios, (m, n)


@pytest.mark.parametrize("shape", [(128, 128), (128, 256), (384, 128), (128, 512)])
def test_native_nvfp4_newton_schulz_lands_within_1_5x_of_bf16_muon_on_every_spectrum_class(shape):
    """Full-Stack FP4's NVFP4 iteration with the coefficients fitted for the shape's aspect ratio lands every spectrum
    class (Gaussian, rank 8 plus noise, power law 1 to 1e-3; draws the fit did not see) within 1.5x of BF16 Muon's
    distance to the orthogonal factor (after the best scalar fit), no singular value above 1.5. Muon's coefficients
    with NVFP4 products blow up or land far off."""
    from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, newton_schulz
    from fp4train.optim.ns_coefficients import nvfp4_coefficients
    from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar, spectrum_classes

    m, n = shape
    coefficients = nvfp4_coefficients(m, n)
    lo, hi = min(shape), max(shape)
    for kind, x in spectrum_classes(lo, hi, seed=11).items():
        x = x if m <= n else x.T
        target = polar(x)
        muon = float(fitted_distance(newton_schulz(x, BF16_COEFFICIENTS).float(), target)[0])
        out = newton_schulz(x, coefficients, matmul="nvfp4")
        d, _ = fitted_distance(out, target)
        top = float(torch.linalg.matrix_norm(out.double(), ord=2))  # what the update applies
        assert float(d) <= 1.5 * muon and top <= 1.5, (kind, float(d), muon, top)
        if kind == "gaussian":
            naive = newton_schulz(x, BF16_COEFFICIENTS, matmul="nvfp4")
            assert not torch.isfinite(naive).all() or float(fitted_distance(naive, target)[0]) > 1.5 * muon


@pytest.mark.parametrize("shape,seed", [((128, 192), 3), ((144, 208), 7), ((130, 200), 5)])
def test_nvfp4_newton_schulz_keeps_a_rounded_spike_of_a_low_rank_matrix_in_bounds(shape, seed):
    """Low rank plus noise at shapes between the table's aspect ratios: without the bound on the largest singular
    value before each step, one direction leaves the quintic's basin (largest singular value 3-12, 2-3x BF16 Muon's
    distance); with it, no singular value above 1.5 and within 1.5x of BF16 Muon."""
    from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, newton_schulz
    from fp4train.optim.ns_coefficients import nvfp4_coefficients
    from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar, spectrum_classes

    x = spectrum_classes(*shape, seed)["rank8+noise"]
    target = polar(x)
    muon = float(fitted_distance(newton_schulz(x, BF16_COEFFICIENTS).float(), target)[0])
    out = newton_schulz(x, nvfp4_coefficients(*shape), matmul="nvfp4")
    top = float(torch.linalg.matrix_norm(out.double(), ord=2))
    assert top <= 1.5 and float(fitted_distance(out, target)[0]) <= 1.5 * muon, (top, muon)


def test_the_fits_batched_nvfp4_is_the_quantizers_nvfp4_on_each_matrix():
    """The coefficient fit's batched NVFP4 (a tensor scale per matrix) gives fp4train's NVFP4 values bit for bit."""
    from fp4train.optim.nvfp4_ns_fit import fake_nvfp4_rows

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 24, 64, generator=g) * torch.logspace(-3, 2, 64) * torch.rand(3, 2, 1, 1, generator=g)
    x[1, 0] = 0.0  # an all-zero matrix: tensor scale 1
    got = fake_nvfp4_rows(x)
    for i in range(3):
        for j in range(2):
            assert torch.equal(got[i, j], fp4train.fake_quantize(x[i, j], "nvfp4", axis=1)), (i, j)


def test_the_nvfp4_iteration_starts_at_the_gram_matrixs_bound_on_the_largest_singular_value():
    """The start divides by ``(sum s^4)^(1/4)`` (from the first, NVFP4, Gram product) times GRAM_MARGIN: the largest
    singular value starts below 1 but well above where ``||G||_F`` puts it (one step (1, 0, 0) returns the start)."""
    from fp4train.optim.newton_schulz import GRAM_MARGIN, newton_schulz

    g = torch.Generator().manual_seed(6)
    x = torch.randn(128, 512, generator=g)
    s = torch.linalg.svdvals(x.double())
    start = newton_schulz(x, ((1.0, 0.0, 0.0),), steps=1, matmul="nvfp4")
    top = float(torch.linalg.matrix_norm(start.double(), ord=2))
    want = float(s[0] / (s.pow(4).sum() ** 0.25 * GRAM_MARGIN))
    assert top < 1 and abs(top - want) < 0.02 * want, (top, want)
    assert top > 2 * float(s[0] / s.square().sum().sqrt())  # the Frobenius start's


def test_the_largest_singular_value_estimate_is_from_below_and_finds_a_separated_spike():
    from fp4train.optim.newton_schulz import top_singular_value

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * 0.05
    x[:, :1] += torch.randn(64, 1, generator=g)  # one spike
    exact = float(torch.linalg.matrix_norm(x.double(), ord=2))
    est = float(top_singular_value(x @ x.T))
    assert exact * 0.97 <= est <= exact * (1 + 1e-5)
    batch = torch.stack([x, 2 * x])
    assert top_singular_value(batch @ batch.transpose(-2, -1)).shape == (2, 1, 1)


def test_nvfp4_newton_schulz_products_quantize_each_operand_along_the_inner_dim():
    """Every NVFP4 product of the iteration quantizes its first operand along its rows and its second along its
    columns (the product's inner dim), as a GEMM's blocks run; the wrong axis gives another product."""
    from fp4train.optim.newton_schulz import _nvfp4_mm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-2, 2, 64)
    y = torch.randn(64, 48, generator=g) * torch.logspace(-2, 2, 48)
    want = fp4train.fake_quantize(x, "nvfp4", axis=1) @ fp4train.fake_quantize(y, "nvfp4", axis=0)
    assert torch.equal(_nvfp4_mm(x, y), want)
    assert not torch.equal(_nvfp4_mm(x, y), fp4train.fake_quantize(x, "nvfp4", axis=1) @ fp4train.fake_quantize(y, "nvfp4", axis=1))


def test_the_kernel_nvfp4_product_is_the_references_product():
    """On a GPU the iteration's products quantize their operands by the Triton kernel inside one opaque op (a compiled
    optimizer step traces none of the quantization): the same operands, bit for bit - the second one quantized in its
    own layout down its columns, the blocks of its transpose's rows. Here in Triton's interpreter."""
    pytest.importorskip("triton")
    from fp4train.formats.quantize import quantize
    from fp4train.optim.newton_schulz import _scaled_mm, nvfp4_kernel_mm

    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-2, 2, 64)
    y = torch.randn(64, 48, generator=g) * torch.logspace(-2, 2, 48)
    want = _scaled_mm(quantize(x, "nvfp4", axis=1).scaled_bf16(), quantize(y.T, "nvfp4", axis=1).scaled_bf16().t())
    assert torch.equal(nvfp4_kernel_mm(x, y), want)
    assert torch.equal(nvfp4_kernel_mm(x, y.T.contiguous().T), want)  # a transposed view, as the iteration passes it


def test_the_kernel_gram_product_quantizes_once_what_the_product_quantizes_twice():
    """The iteration's Gram matrices ``X X^T`` (2D and stacked): both operands are X in blocks along its rows, so the
    kernel quantizes X once and multiplies it transposed - the same operand values as :func:`nvfp4_kernel_mm`
    ``(X, X^T)`` quantizes twice, their product up to FP32 summation order (here in Triton's interpreter)."""
    pytest.importorskip("triton")
    from fp4train.kernels import nvfp4_values
    from fp4train.kernels.nvfp4_values import nvfp4_stacked_values
    from fp4train.optim.newton_schulz import _nvfp4_gram, _nvfp4_mm, nvfp4_kernel_gram, nvfp4_kernel_mm

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 32, 64, generator=g) * torch.logspace(-2, 2, 64)
    rows, cols = nvfp4_values(x[0], axis=1), nvfp4_values(x[0].T.contiguous(), axis=0)
    assert torch.equal(rows.values, cols.values.T) and torch.equal(rows.divisor, cols.divisor)
    (vr, sr), (vc, sc) = nvfp4_stacked_values(x, axis=2), nvfp4_stacked_values(x.mT.contiguous(), axis=1)
    assert torch.equal(vr, vc.mT) and torch.equal(sr, sc)
    for a in (x[0], x):
        torch.testing.assert_close(nvfp4_kernel_gram(a), nvfp4_kernel_mm(a, a.transpose(-2, -1)), rtol=1e-4, atol=0)
        assert torch.equal(_nvfp4_gram(a), _nvfp4_mm(a, a.transpose(-2, -1)))  # the reference: the product itself


def test_a_stack_of_updates_takes_each_matrixs_own_nvfp4_iteration():
    """Q-Root's same-shape parameters orthogonalized as one stack (one launch a pass for all their NVFP4 operands): each
    matrix quantized with its own tensor scale, each parameter moved as by its own step - up to the order of the sums,
    far below NVFP4's rounding; the stacked product is each matrix's product."""
    pytest.importorskip("triton")
    from fp4train.optim.newton_schulz import nvfp4_kernel_mm
    from fp4train.optim.qmuon import _orthogonalized_step, _stacked_orthogonalized_steps

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, 64, generator=g) * torch.logspace(-2, 2, 3)[:, None, None]
    y = torch.randn(3, 64, 48, generator=g)
    stacked = nvfp4_kernel_mm(x, y)
    for i in range(3):
        assert torch.equal(stacked[i], nvfp4_kernel_mm(x[i], y[i])), i
    updates = torch.randn(3, 96, 48, generator=g) * torch.logspace(-3, 0, 3)[:, None, None]
    eps = updates.abs().flatten(1).quantile(0.99, dim=1)
    w = torch.randn(3, 96, 48, generator=g)
    step = dict(coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, ns_matmul="nvfp4", decay=0.99, step_lr=0.1)
    one = [w[i].clone() for i in range(3)]
    for i in range(3):
        _orthogonalized_step(one[i], updates[i], eps[i], **step)
    together = [w[i].clone() for i in range(3)]
    _stacked_orthogonalized_steps(together, updates, eps, **step)
    for a, b, w0 in zip(one, together, w):
        assert (a - w0).abs().max() > 1e-3  # the step moved the parameter
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_the_nvfp4_iteration_moves_with_a_rounding_flip_but_stays_as_orthogonal():
    """Why a compiled (or stacked, or GPU) NVFP4 step is compared with the eager one by its distance to the orthogonal
    factor and not element by element: a 1e-6 relative change of the input flips some operand's rounding, and five
    NVFP4 products carry the flip to another point of their error ball - percents away - at the same distance."""
    from fp4train.optim.newton_schulz import newton_schulz
    from fp4train.optim.ns_coefficients import nvfp4_coefficients
    from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar

    g = torch.Generator().manual_seed(1)
    u = torch.randn(256, 128, generator=g)
    coefficients, target = nvfp4_coefficients(128, 256), polar(u)
    base = newton_schulz(u, coefficients, matmul="nvfp4")
    d_base = float(fitted_distance(base, target)[0])
    moved = []
    for s in range(4):
        nudged = u * (1 + 1e-6 * torch.randn(u.shape, generator=torch.Generator().manual_seed(s)))
        out = newton_schulz(nudged, coefficients, matmul="nvfp4")
        moved.append(float((out - base).norm() / base.norm()))
        assert abs(float(fitted_distance(out, target)[0]) - d_base) < 0.01
    assert max(moved) > 0.02, moved  # percents, where an FP32 iteration would move by ~1e-6


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
    assert opt.param_groups[0]["ns_coefficients"] == "nvfp4"  # fitted for NVFP4 products, by shape
    for i in range(3):
        _muon_grads(params, i)
        opt.step()
    assert torch.isfinite(params[0]).all()
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="2D weights only"):
        QMuon([{"params": [w], "muon": True}])
    with pytest.raises(ValueError, match="ns_matmul"):
        QMuon([w], ns_matmul="fp8")
    with pytest.raises(ValueError, match="fitted for NVFP4 products"):
        QMuon([w], ns_coefficients="nvfp4")


def _orthogonality_error(x: torch.Tensor, coefficients) -> float:
    """RMS distance from 1 of the singular values after 5 quintic Newton-Schulz steps (FP64)."""
    from fp4train.optim.ns_coefficients import iterate

    s = torch.linalg.svdvals(x.double() / x.double().norm())
    return float(((iterate(s, coefficients, 5) - 1) ** 2).mean().sqrt())


@pytest.mark.parametrize("shape", [(64, 256), (256, 1024), (128, 128), (512, 192)])
def test_root_coefficients_fitted_per_shape_land_random_matrices_nearer_orthogonal(shape):
    """Coefficients fitted to a shape's random-matrix spectrum land Gaussian matrices of that shape nearer the
    orthogonal factor than Muon's one set (and, as measured, low-rank updates farther: not the default); either
    orientation gets the same. Root's released coefficients are looked up by shape, Muon's elsewhere."""
    from fp4train.optim.ns_coefficients import MUON_COEFFICIENTS, ROOT_RELEASE_COEFFICIENTS, fitted_coefficients, shape_coefficients

    fitted = fitted_coefficients(*shape)
    assert fitted == fitted_coefficients(shape[1], shape[0]) and fitted != MUON_COEFFICIENTS
    g = torch.Generator().manual_seed(sum(shape))
    for _ in range(2):
        x = torch.randn(shape, generator=g)
        assert _orthogonality_error(x, fitted) < 0.9 * _orthogonality_error(x, MUON_COEFFICIENTS)
    with pytest.raises(ValueError, match="positive shape"):
        fitted_coefficients(0, 4)
    assert shape_coefficients(*shape) == MUON_COEFFICIENTS
    assert shape_coefficients(8192, 2048) == shape_coefficients(2048, 8192) == ROOT_RELEASE_COEFFICIENTS[(2048, 8192)]


def test_root_robust_part_is_the_momentum_less_its_soft_thresholded_outliers():
    from fp4train.optim.qmuon import robust_part

    g = torch.Generator().manual_seed(1)
    u = torch.randn(64, 96, generator=g) * torch.logspace(-2, 1, 96)
    u[3, 5] = 1e4  # an outlier
    got = robust_part(u, 0.9)
    eps = torch.quantile(u.abs().flatten(), 0.9) + 1e-9
    soft = torch.sign(u) * torch.relu(u.abs() - eps)  # the outliers Root takes out
    torch.testing.assert_close(got, u.clamp(-eps, eps), rtol=0, atol=1e-6)  # the same, without FP32's cancellation:
    small = u.abs() < 100  # u - soft subtracts two near-equal numbers at the outlier
    torch.testing.assert_close(got[small], (u - soft)[small], rtol=0, atol=1e-6)
    assert float(got.abs().max()) == pytest.approx(float(eps), rel=1e-6) and got[3, 5] < 1e3
    assert abs(float((u.abs() > eps).float().mean()) - 0.1) < 0.01  # a tenth of the entries clipped
    assert torch.equal(robust_part(u, 1.0), u.clamp(-u.abs().max() - 1e-9, u.abs().max() + 1e-9))


def _root_reference(w: torch.Tensor, grads, lr: float, wd: float, mu: float = 0.95) -> torch.Tensor:
    """Root in FP32/BF16 written out from the paper: Nesterov momentum, the update clipped at the 0.9 quantile of its
    magnitudes, Newton-Schulz with the released coefficients for the shape (Muon's elsewhere), decoupled decay,
    lr 0.2 sqrt(max dim)."""
    import math

    from fp4train.optim.newton_schulz import newton_schulz
    from fp4train.optim.ns_coefficients import ROOT_RELEASE_COEFFICIENTS

    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = buf + (1 - mu) * (g - buf)
        u = g + mu * (buf - g)
        eps = torch.quantile(u.abs().flatten(), 0.9) + 1e-9
        u = u - torch.sign(u) * torch.relu(u.abs() - eps)
        o = newton_schulz(u, ROOT_RELEASE_COEFFICIENTS.get(tuple(sorted(w.shape)), (3.4445, -4.775, 2.0315)), 5)
        w = w * (1 - lr * wd) - 0.2 * math.sqrt(max(w.shape)) * lr * o
    return w


def test_root_without_quantized_states_is_roots_update_and_qroot_tracks_it(monkeypatch):
    """QRoot(quantize_states=False) follows Root written out from the paper over 8 steps (the same arithmetic up to
    the FP32 rounding of the clip); with NVFP4 momentum (QRoot) the weights stay within a few percent of it. The
    test's shape is given coefficients of its own in the released table, so that the lookup is exercised."""
    from fp4train.optim import QRoot
    from fp4train.optim import ns_coefficients

    monkeypatch.setitem(ns_coefficients.ROOT_RELEASE_COEFFICIENTS, (64, 128), (3.0, -3.6, 1.6))

    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(64, 128, generator=g) * 0.02
    grads = [torch.randn(64, 128, generator=g) * torch.logspace(-1, 1, 128) for _ in range(8)]
    want = _root_reference(w0, grads, lr=1e-2, wd=0.1)
    runs, groups = {}, {}
    for quantized, ns in ((False, None), (True, "bf16"), (True, None)):
        p = torch.nn.Parameter(w0.clone())
        opt = QRoot([{"params": [p], "muon": True}], lr=1e-2, weight_decay=0.1, quantize_states=quantized, ns_matmul=ns)
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
        runs[quantized, ns], groups[quantized, ns] = p.detach(), opt.param_groups[0]
    # Root in BF16 takes the shape's coefficients; Q-Root's default is Full-Stack FP4's native NVFP4 Newton-Schulz
    assert groups[False, None]["ns_coefficients"] == "shape" and groups[False, None]["ns_matmul"] == "bf16"
    assert groups[True, None]["ns_coefficients"] == "nvfp4" and groups[True, None]["ns_matmul"] == "nvfp4"
    assert groups[True, None]["robust_quantile"] == 0.9
    moved = (want - w0).norm()
    assert float((runs[False, None] - want).norm() / moved) < 1e-2
    assert float((runs[True, "bf16"] - want).norm() / moved) < 0.25
    assert float((runs[True, None] - want).norm() / moved) < 0.5
    assert opt.state[p]["momentum_buffer.codes"].dtype == torch.uint8
    with pytest.raises(ValueError, match="robust_quantile"):
        QRoot([p], robust_quantile=1.5)
    with pytest.raises(ValueError, match="ns_coefficients"):
        QRoot([p], ns_coefficients="tuned")


# ---- stored states follow their gradients (many steps against an FP32 twin) ------------------------
def _twin_run(grads, *, stochastic: bool, betas=(0.9, 0.95), lr=1.0, seed: int = 0):
    """A parameter updated by QAdamW (stochastic rounding from ``seed``) and one by FP32 AdamW
    (``quantize_states=False``: torch's arithmetic), both from zero with the same gradient stream; returns both
    parameters and both optimizers."""
    from fp4train.optim import QAdamW

    q = torch.zeros(grads[0].shape, requires_grad=True)
    f = torch.zeros(grads[0].shape, requires_grad=True)
    oq = QAdamW([q], lr=lr, betas=betas, weight_decay=0.0, stochastic_states=stochastic, seed=seed)
    of = QAdamW([f], lr=lr, betas=betas, weight_decay=0.0, quantize_states=False)
    for g in grads:
        q.grad, f.grad = g.clone(), g.clone()
        oq.step()
        of.step()
    return q, f, oq, of


def _stored_moments(opt, p):
    from fp4train.optim import state_codec

    st = opt.state[p]
    if "exp_avg" in st:
        return st["exp_avg"], st["exp_avg_sq"]
    sub = lambda name: {k.split(".", 1)[1]: t for k, t in st.items() if k.startswith(name + ".")}  # noqa: E731
    return state_codec.decode_signed(sub("exp_avg"), p.shape), state_codec.decode_second_moment(sub("exp_avg_sq"), p.shape)


def stopped_gradient_drift(stochastic: bool) -> tuple[float, float]:
    """10 steps of Gaussian gradients, then 100 where one entry per 16-block keeps a large gradient and the others get
    none: how far the stopped entries still move (mean |change|), under QAdamW and under its FP32 twin. Also
    ``bench/optimizer_states.py``'s synthetic case."""
    g = torch.Generator().manual_seed(0)
    warm = [torch.randn(32, 32, generator=g) for _ in range(10)]
    live = torch.zeros(32, 32)
    live[:, ::16] = 1.0
    after = [torch.randn(32, 32, generator=g).abs() * 30 * live for _ in range(100)]
    q0, f0, *_ = _twin_run(warm, stochastic=stochastic)
    q, f, *_ = _twin_run(warm + after, stochastic=stochastic)
    dead = live == 0
    return (q - q0).detach()[dead].abs().mean().item(), (f - f0).detach()[dead].abs().mean().item()


def variance_drop_ratios(stochastic: bool, seed: int = 0) -> tuple[float, float]:
    """50 steps of unit-variance gradients, then 3,000 with half the columns' variance 100x lower (beta2 0.999): v on
    those columns over v on the others, stored by QAdamW (stochastic rounding from ``seed``) and by its FP32 twin.
    Also ``bench/optimizer_states.py``'s."""
    g = torch.Generator().manual_seed(1)
    scale = torch.ones(32, 32)
    grads = [torch.randn(32, 32, generator=g) for _ in range(50)]
    scale[:, 16:] = 0.1  # std / 10: variance / 100
    grads += [torch.randn(32, 32, generator=g) * scale for _ in range(3000)]
    q, f, oq, of = _twin_run(grads, stochastic=stochastic, betas=(0.9, 0.999), seed=seed)
    vq, vf = _stored_moments(oq, q)[1], _stored_moments(of, f)[1]
    return (vq[:, 16:].mean() / vq[:, :16].mean()).item(), (vf[:, 16:].mean() / vf[:, :16].mean()).item()


def test_entries_whose_gradient_stops_decay_as_in_fp32_adamw():
    """One entry per 16-block keeps a large gradient, the others' gradients stop: their moments must decay and the
    parameter stop moving, as FP32 AdamW's do. Rounded to nearest, an entry on an E2M1 grid point re-encodes to itself
    after each decay (its block's scale is held by the live entry) and keeps moving."""
    moved = {stochastic: stopped_gradient_drift(stochastic) for stochastic in (True, False)}
    fp32 = moved[True][1]
    assert 0.3 * fp32 < moved[True][0] < 2 * fp32, moved  # stochastic rounding: FP32's drift, within its noise
    assert moved[False][0] > 3 * fp32, moved  # what nearest rounding does (the failure this guards against)


def test_the_second_moment_follows_a_hundredfold_drop_of_the_gradient_variance():
    """Half the columns' gradient variance drops 100x: with beta2 = 0.999, FP32's v on them falls to ~1/80 of the
    others' over 3,000 steps. Rounded to nearest, the stored v stops at ~1/6 (its re-encoded residuals stick);
    stochastically rounded it follows most of the way for most seeds, to 1.3-6x FP32's ratio, but a seed can stall
    (through last-bit differences of the CPU's kernels, which seed depends on the machine: on an Intel CPU seed 2
    ends at 0.18, above nearest's 0.16, while seven others of ten end under 0.04). So over five seeds the median must
    come under half of nearest's ratio and at least four seeds under nearest's. Not covered: the same drop in every
    other column, where the decoded sqrt(v)'s noise, squared, adds to v and neither rounding follows
    (docs/findings.md)."""
    sr = [variance_drop_ratios(True, seed) for seed in range(5)]
    fp32 = sr[0][1]
    nearest = variance_drop_ratios(False)[0]
    assert fp32 < 0.02 and nearest > 5 * fp32, (fp32, nearest)
    ratios = [r for r, _ in sr]
    assert statistics.median(ratios) < nearest / 2 and sum(r < nearest for r in ratios) >= 4, (ratios, nearest, fp32)


def test_stored_moments_track_their_fp32_twin_over_many_steps_not_only_one_encode():
    """Over 400 steps of a gradient stream with heavy-tailed, column-structured scales, the carried moments stay
    within a small multiple of one encode's error of FP32 AdamW's (rounded to nearest, v drifts away by orders of
    magnitude). Stochastic rounding pays with noise: the carried m errs by about 4x one encode's error."""
    from fp4train.optim import state_codec

    g = torch.Generator().manual_seed(2)
    cols = torch.exp(torch.randn(64, generator=g))
    grads = [torch.randn(64, 64, generator=g) * cols * (1 + 0.5 * torch.sin(torch.tensor(t / 20.0))) for t in range(400)]
    err = {}
    for stochastic in (True, False):
        q, f, oq, of = _twin_run(grads, stochastic=stochastic)
        (mq, vq), (mf, vf) = _stored_moments(oq, q), _stored_moments(of, f)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        one_m = rel(state_codec.decode_signed(state_codec.encode_signed(mf), mf.shape), mf)
        one_v = rel(state_codec.decode_second_moment(state_codec.encode_second_moment(vf), vf.shape), vf)
        err[stochastic] = (rel(mq, mf), rel(vq, vf), one_m, one_v)
    m_err, v_err, one_m, one_v = err[True]
    assert m_err < 5 * one_m and v_err < 5 * one_v, err
    assert err[False][1] > 10 * v_err, err


def test_stochastic_state_keys_differ_by_parameter_step_and_state_and_follow_the_seed():
    from fp4train.optim import QAdamW

    a, b = torch.zeros(16, 16, requires_grad=True), torch.zeros(16, 16, requires_grad=True)
    opt = QAdamW([a, b])
    keys = {(p, s, w): tuple(opt.state_keys(x, s, w).tolist()) for p, x in (("a", a), ("b", b)) for s in (1, 2) for w in (0, 1)}
    assert len(set(keys.values())) == 8
    assert tuple(QAdamW([a, b], seed=1).state_keys(a, 1, 0).tolist()) != keys[("a", 1, 0)]
    assert QAdamW([a], stochastic_states=False).state_keys(a, 1, 0) is None


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_roots_order_statistics_are_the_same_on_either_path(n):
    """The GPU's path to the quantile's order statistics (through the largest entries) gives the CPU's selection,
    ties included, each row of a batch its own."""
    from fp4train.optim.qmuon import _by_largest, _by_selection

    g = torch.Generator().manual_seed(n)
    for a in (torch.rand(3, n, generator=g), torch.randint(0, 4, (3, n), generator=g).float()):
        for lo in {0, n // 3, n - 2, n - 1} - {-1}:
            for hi in {lo, min(lo + 1, n - 1)}:
                got, sel = _by_largest(a, lo, hi), _by_selection(a, lo, hi)
                for r in range(a.shape[0]):
                    want = sorted(a[r].tolist())
                    assert (float(got[0][r]), float(got[1][r])) == (want[lo], want[hi]) == (float(sel[0][r]), float(sel[1][r]))


@pytest.mark.parametrize("multi_tensor,ns_matmul", [(False, "bf16"), (True, "bf16"),
                                                    pytest.param(False, "nvfp4", marks=pytest.mark.slow)])
def test_compiled_root_tracks_the_eager_one_and_compiles_once_per_shape(multi_tensor, ns_matmul):
    """QRoot(compiled=True): the momentum's decode, Root's update and the encode as one compiled call per shape, equal
    to the eager step up to the rounding of fused operations, however the learning rate moves. (With NVFP4
    Newton-Schulz, Full-Stack FP4's default, the compile takes minutes on a CPU: a slow check; the multi-tensor
    path takes it per parameter.)"""
    from torch._dynamo.utils import counters

    from fp4train.optim import QRoot

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    shapes = [(64, 128), (128, 64), (32, 64), (64, 128)]  # two of a shape: updated by one call
    eager = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    starts = [p.detach().clone() for p in eager]
    opts = _eager_beside_compiled(lambda ps, c: QRoot([{"params": ps, "muon": True}], lr=1e-2, weight_decay=0.1, compiled=c,
                                                      multi_tensor=c and multi_tensor, ns_matmul=ns_matmul),
                                  eager, fused, scales=[1, 1, 1, 100])  # two of a shape, far apart: each its own threshold
    for a, b, start in zip(eager, fused, starts):  # BF16 Newton-Schulz and the NVFP4 codes amplify any rounding
        # difference: a gradient changed by 1e-6 (relative) moves the result by 0.3-0.5% of its path, fusion by ~1%
        assert float((a - b).norm() / (a - start).norm()) < 0.03
    assert counters["stats"]["unique_graphs"] == 2 * len(set(shapes))  # per shape the momenta and the steps: Root's
    # clip thresholds (a library call) are taken between them
    assert all(opts[1].state[p]["momentum_buffer.codes"].dtype == torch.uint8 for p in fused)
