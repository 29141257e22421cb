"""``Quantizer("compiled")``: torch.compile'd reference cores give the reference's bits."""

import pytest
import torch

import fp4train
from fp4train.quantizer import Quantizer, compiled
from fp4train.transforms.hadamard import block_transform, hadamard_tensors, signs

CASES = [
    ("mxfp4", dict(rounding="nearest")),
    ("mxfp4", dict(scale="ceil", rounding="stochastic", seed=2**40 + 3)),
    ("nvfp4", dict(rounding="stochastic", seed=5)),
    ("fp8", {}),
]
COMPILED = Quantizer("compiled")


def _x(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    x[3, 5] = float("nan")
    x[7, :32] = 0.0
    return x.to(device)


def _check(device, cases=CASES):
    x = _x(device)
    for fmt, kw in cases:
        ref, q = fp4train.quantize(x, fmt, **kw), COMPILED.quantize(x, fmt, **kw)
        assert torch.equal(q.codes, ref.codes), fmt
        torch.testing.assert_close(q.scales, ref.scales, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(q.dequantize(), ref.dequantize(), rtol=0, atol=0, equal_nan=True)
        # the fused quantize-and-split of an operand a GEMM takes at once: the same bits, but for the sign of
        # zeros (on a GPU the compiled split gives +0 where the reference keeps the input's sign: seen on the
        # H200; a GEMM's sums cannot tell them apart)
        v, s = COMPILED.values(x, fmt, kw, axis=-1, seed=kw.get("seed")), ref.scaled_bf16()
        assert torch.equal(_bits_but_zero_sign(v.values), _bits_but_zero_sign(s.values)), fmt
        for f in ("scale", "divisor"):
            a, b = getattr(v, f), getattr(s, f)
            assert (a is None) == (b is None), (fmt, f)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _bits_but_zero_sign(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit patterns with -0 made +0 (``-0 + 0 = +0``; NaN and every other value keep their bits)."""
    return torch.where(t == 0, torch.zeros_like(t), t).view(torch.int16)


# each case compiles its own graphs (tens of seconds on a CPU): MXFP4 nearest on every run, the rest with --runslow
@pytest.mark.parametrize("case", [CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in CASES[1:])],
                         ids=lambda c: f"{c[0]}-{c[1].get('rounding', 'nearest')}")
def test_compiled_numerics_equal_eager_on_cpu(case):
    _check("cpu", [case])


def test_compiled_hadamard_equals_eager_on_cpu():
    x = _x("cpu")
    for seed in (None, 7):
        assert torch.equal(COMPILED.hadamard(x, 32, axis=-1, seed=seed).nan_to_num(), fp4train.hadamard(x, 32, seed=seed).nan_to_num())
        d = signs(seed, 32) if seed is not None else None
        inv = hadamard_tensors(x, d, block=32, axis=-1, inverse=True, core=compiled(block_transform))
        torch.testing.assert_close(inv, fp4train.hadamard(x, 32, seed=seed, inverse=True), rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
def test_compiled_numerics_equal_eager_on_gpu():
    _check("cuda")


@pytest.mark.cuda
def test_exact_bf16_gemm_on_gpu_matches_fp32():
    from fp4train.backends import get

    a = fp4train.quantize(torch.randn(256, 512, device="cuda"), "mxfp4")
    b = fp4train.quantize(torch.randn(128, 512, device="cuda"), "mxfp4")
    fast = get("emulated").gemm(a, b, torch.float32)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


VALUES_CASES = [("nvfp4", dict(four_over_six=True), -1), ("mxfp4", {}, -1), ("nvfp4", dict(four_over_six=True), 0),
                ("mxfp8", {}, 0), ("mxfp4", dict(block=(32, 32), scale="ceil"), -1), ("nvfp4", dict(block=(16, 16)), -1)]
VALUES_SHAPES = ((64, 128), (32, 256), (96, 192), (64, 160))


@pytest.fixture
def recorded_graphs(monkeypatch):
    """The graphs the compiled cores make (traced, run as they are, no Inductor), from fresh caches."""
    import fp4train.quantizer as quantizer

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(quantizer.torch, "compile", lambda fn, **k: real(fn, **k, backend=record))
    compiled.cache_clear()
    torch._dynamo.reset()
    yield graphs
    compiled.cache_clear()
    torch._dynamo.reset()


def test_compiled_values_graphs_size_blocks_exactly_over_changing_shapes_and_formats(recorded_graphs):
    """Over operands of changing shape, format and orientation in one process the compiled values path gives the
    reference's bits, and its graphs' sizes hold no floor division: a size split into blocks by a symbolic width
    or block size, ``n // (n // 16)``, is a loop that Inductor's GPU code generation cannot split (``CantSplit``,
    in a compiled Full-Stack FP4 step on an H100, and where MXFP4's block of 32 followed NVFP4's 16)."""
    for fmt, kw, axis in VALUES_CASES:
        for shape in VALUES_SHAPES:
            x = torch.randn(*shape)
            v = COMPILED.values(x, fmt, kw, axis=axis, seed=None)
            s = fp4train.quantize(x, fmt, axis=axis, **kw).scaled_bf16()
            assert torch.equal(_bits_but_zero_sign(v.values), _bits_but_zero_sign(s.values)), (fmt, kw, axis, shape)
    graphs = recorded_graphs
    sizes = {str(tuple(n.meta["example_value"].shape)) for gm in graphs for n in gm.graph.nodes
             if isinstance(n.meta.get("example_value"), torch.Tensor)}
    assert graphs and not [t for t in sizes if "//" in t], sizes


@pytest.mark.cuda
def test_compiled_values_on_gpu_over_changing_shapes_and_formats_equal_the_cpu_reference():
    """Inductor's GPU code generation compiles the values path's graphs as shapes and formats change (symbolic
    sizes after the second shape) and they give the CPU reference's bits; a padded size (80 rows of 32x32 tiles)
    compiles a graph of its own."""
    compiled.cache_clear()
    torch._dynamo.reset()
    for fmt, kw, axis in VALUES_CASES:
        for shape in ((256, 512), (128, 1024), (384, 768), (256, 512), (80, 160)):
            x = torch.randn(*shape)
            v = COMPILED.values(x.cuda(), fmt, kw, axis=axis, seed=None)
            s = fp4train.quantize(x, fmt, axis=axis, **kw).scaled_bf16()
            assert torch.equal(_bits_but_zero_sign(v.values.cpu()), _bits_but_zero_sign(s.values)), (fmt, axis, shape)
            if s.divisor is not None:
                torch.testing.assert_close(v.divisor.cpu(), s.divisor, rtol=0, atol=0)


def test_a_call_that_would_compile_inside_a_cuda_graph_capture_runs_eagerly(recorded_graphs, monkeypatch):
    """Inside a capture (here pretended: the CPU has none) a compiled core never compiles - compiling launches
    work a capture refuses, which stopped a Full-Stack FP4 step's capture on an H100 - but runs the reference ops
    with the same bits; a graph compiled before the capture still runs."""
    import fp4train.quantizer as quantizer

    kw = dict(four_over_six=True)
    x = torch.randn(64, 128)
    COMPILED.values(x, "nvfp4", kw, axis=-1, seed=None)  # a warm-up call compiles
    assert len(recorded_graphs) == 1
    monkeypatch.setattr(quantizer, "capturing", lambda: True)
    for shape in ((64, 128), (32, 256)):  # one compiled before, one never
        x = torch.randn(*shape)
        v, s = COMPILED.values(x, "nvfp4", kw, axis=-1, seed=None), fp4train.quantize(x, "nvfp4", **kw).scaled_bf16()
        assert torch.equal(_bits_but_zero_sign(v.values), _bits_but_zero_sign(s.values)), shape
    assert len(recorded_graphs) == 1
