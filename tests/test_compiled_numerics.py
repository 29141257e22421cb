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


def test_compiled_cores_keep_integer_arguments_constant_and_only_changing_sizes_symbolic(monkeypatch):
    """A compiled core's graph takes as symbols only the sizes that changed between calls: the block size and the
    other integer arguments stay constants (with every integer symbolic, Inductor's GPU code generation failed to
    split a block off its loop, ``CantSplit``, in a compiled Full-Stack FP4 step)."""
    import fp4train.quantizer as quantizer

    graphs = []

    def record(gm, example_inputs):
        graphs.append([int(a.node.hint) for a in example_inputs if isinstance(a, torch.SymInt)])
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(quantizer.torch, "compile", lambda fn, **kw: real(fn, **kw, backend=record))
    compiled.cache_clear()
    torch._dynamo.reset()
    try:
        shapes = ((64, 128), (32, 256), (96, 192))
        for shape in shapes:
            compiled(quantizer.operand_values)(torch.randn(*shape), None, fmt="nvfp4", block=(1, 16), block_axis=1,
                                               scale="floor", four_over_six=True)
    finally:
        compiled.cache_clear()
        torch._dynamo.reset()
    sizes = {n for shape in shapes for n in shape}
    assert graphs and all(set(g) <= sizes for g in graphs), graphs
