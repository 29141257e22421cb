"""`numerics="triton"`: a layer's quantizer gives the same bits with Triton kernels as with the reference."""

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

import fp4train  # noqa: E402
from fp4train.quantizer import Quantizer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = Quantizer("triton")


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", "tib2d", "tib2d-qk", "hadamard_mxfp4", "adahop-oe", "fp8_rowwise"])
def test_triton_numerics_layer_is_bit_identical(recipe, layer_run, spec_of):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(DEV)
    x = torch.randn(64, 64, device=DEV)
    x[:, 3] *= 20
    dy = torch.randn(64, 96, device=DEV)
    outs = []
    for mode in ("eager", "triton"):
        outs.append(layer_run(lin, spec_of(recipe), x, dy, numerics=mode))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_kernel_dispatch_covers_axis_0_and_falls_back(monkeypatch):
    x = torch.randn(64, 96, device=DEV)
    for kw in (dict(axis=0), dict(axis=-1, rounding="stochastic", seed=3), dict(axis=0, scale="ceil")):
        a = TRITON.quantize(x, "mxfp4", **kw)
        b = fp4train.quantize(x, "mxfp4", **kw)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and a.layout == b.layout
    calls = []
    from fp4train.kernels import nvfp4_tiles

    real = nvfp4_tiles.quantize_nvfp4_2d  # what the quantizer dispatches to
    monkeypatch.setattr(nvfp4_tiles, "quantize_nvfp4_2d", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = TRITON.quantize(x, "nvfp4", block=(16, 16))  # NVFP4 16x16 tiles (the nvfp4 recipe's W): the tile kernel
    b = fp4train.quantize(x, "nvfp4", block=(16, 16))
    assert calls == [1] and torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and a.layout == b.layout
    odd = torch.randn(5, 40, device=DEV)  # not whole blocks: the reference runs
    assert TRITON.quantize(odd, "mxfp4").dequantize().shape == (5, 40)
    with pytest.raises(ValueError, match="unknown numerics 'fast'"):
        Quantizer("fast")


@pytest.mark.slow  # minutes of interpreted kernels on a CPU; each layer is checked above
def test_triton_numerics_training_curve_equals_eager(tmp_path, tiny_curve):
    """`tiny` under hadamard_mxfp4 (Hadamard + MXFP4 kernels, SR gradients), trained under
    `--numerics triton`, has the eager run's loss at every step. On a CPU (kernels interpreted)
    the curves are equal; on a GPU within 2e-3 relative, because GPU training itself is not
    deterministic run to run (atomics in backward kernels)."""
    curves = [tiny_curve(tmp_path / mode, "hadamard_mxfp4", 3, DEV, numerics=mode) for mode in ("eager", "triton")]
    assert len(curves[0]) == 3
    if DEV == "cpu":
        assert curves[0] == curves[1]
    else:
        torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-3, atol=0)


def test_cpu_tensors_take_the_reference_under_triton_numerics_without_the_interpreter(monkeypatch):
    """A CPU tensor given to a quantizer with triton numerics (a layer kept on the CPU of a GPU machine) must not
    reach a Triton kernel, which cannot run it outside the interpreter."""
    from fp4train.kernels import fp8_values, mx_quantize, nvfp4_quantize

    def no_kernel(*a, **k):
        raise AssertionError("a CPU tensor reached a Triton kernel")

    x = torch.randn(64, 96)
    want = {fmt: fp4train.quantize(x, fmt) for fmt in ("mxfp4", "nvfp4", "mxfp8", "fp8")}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU machine
    for mod, name in ((mx_quantize, "quantize_mxfp4"), (mx_quantize, "quantize_mxfp8"), (nvfp4_quantize, "quantize_nvfp4"),
                      (mx_quantize, "quantize_mxfp4_2d"), (fp8_values, "quantize_fp8_rowwise")):
        monkeypatch.setattr(mod, name, no_kernel)
    for fmt, ref in want.items():
        got = TRITON.quantize(x, fmt)
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    TRITON.quantize(x, "mxfp4", block=(32, 32))  # the 32x32 tiles too: no kernel
