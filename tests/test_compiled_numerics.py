"""``fp4train.formats.set_compiled``: torch.compile'd numerics give the same bits as eager."""

import pytest
import torch

import fp4train
from fp4train.formats import set_compiled

CASES = [
    ("mxfp4", dict(rounding="nearest")),
    ("mxfp4", dict(scale="ceil", rounding="stochastic", seed=2**40 + 3)),
    ("nvfp4", dict(rounding="stochastic", seed=5)),
    ("fp8", {}),
]


@pytest.fixture
def compiled():
    set_compiled(True)
    yield
    set_compiled(False)


def _x(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    x[3, 5] = float("nan")
    x[7, :32] = 0.0
    return x.to(device)


def _check(device):
    x = _x(device)
    eager = {}
    set_compiled(False)
    for fmt, kw in CASES:
        q = fp4train.quantize(x, fmt, **kw)
        eager[(fmt, str(kw))] = (q.codes, q.scales, q.dequantize())
    set_compiled(True)
    for fmt, kw in CASES:
        q = fp4train.quantize(x, fmt, **kw)
        c, s, d = eager[(fmt, str(kw))]
        assert torch.equal(q.codes, c), fmt
        torch.testing.assert_close(q.scales, s, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(q.dequantize(), d, rtol=0, atol=0, equal_nan=True)


def test_compiled_numerics_equal_eager_on_cpu(compiled):
    _check("cpu")
    x = _x("cpu")
    set_compiled(True)
    h = [fp4train.hadamard(x, 32, seed=s, inverse=inv) for s in (None, 7) for inv in (False, True)]
    set_compiled(False)
    e = [fp4train.hadamard(x, 32, seed=s, inverse=inv) for s in (None, 7) for inv in (False, True)]
    for a, b in zip(h, e):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
def test_compiled_numerics_equal_eager_on_gpu(compiled):
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
