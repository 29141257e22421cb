"""ScaledBF16: the exact BF16 split of quantized operands (the CUDA emulated GEMM's input)."""

import pytest
import torch

import fp4train
from fp4train.backends.emulated import _bf16_factors

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-3, 3, 48)[:, None]
    x[5, 7] = float("nan")
    return x


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4", "fp8"])
@pytest.mark.parametrize("transposed", [False, True])
def test_scaled_bf16_recomposes_the_reference_bit_for_bit(fmt, transposed):
    x = _x()
    # blocks along the GEMM's inner (last) dimension, directly or through a free transpose
    q = fp4train.quantize(x.T.contiguous(), fmt, axis=0).t() if transposed else fp4train.quantize(x, fmt)
    assert q.block_axis == 1
    s = q.scaled_bf16()
    assert s.values.dtype == torch.bfloat16 and s.shape == q.shape
    torch.testing.assert_close(s.dequantize(), q.dequantize(torch.float32), rtol=0, atol=0, equal_nan=True)
    # the transpose keeps the scale with its axis
    torch.testing.assert_close(s.t().dequantize(), q.t().dequantize(torch.float32), rtol=0, atol=0, equal_nan=True)
    v, row, div = _bf16_factors(q)
    assert (row is not None) == (fmt == "fp8") and (div is not None) == (fmt == "nvfp4")
    assert torch.isnan(s.dequantize()[5]).any()


def test_split_needs_blocks_along_the_inner_dim_and_bf16_tensors():
    q = fp4train.quantize(_x(), "fp8", axis=0)  # row scales along dim 1: not a GEMM operand's rows
    assert _bf16_factors(q) is None
    assert _bf16_factors(torch.randn(4, 4)) is None
    assert _bf16_factors(torch.randn(4, 4).bfloat16()) is not None
    with pytest.raises(ValueError, match="2D"):
        fp4train.quantize(torch.randn(2, 3, 32), "mxfp4").scaled_bf16()


def test_auto_backend_is_fp8_blockwise_on_a_gpu_machine_and_emulated_elsewhere(monkeypatch):
    from fp4train import backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    fp4train.convert(model, "mxfp4")  # the presets' backend is "auto"
    assert fp4train.recipes.get("mxfp4").backend == "auto"
    assert backends.resolve("auto") == "emulated" and model[0].backend.name == "emulated"
    with pytest.raises(ValueError, match="unknown GEMM backend 'fast'.*emulated, fp8_blockwise .*'auto'"):
        backends.resolve("fast")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert backends.resolve("auto") == "fp8_blockwise"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    fp4train.convert(model, "mxfp4")
    assert model[0].backend.name == "fp8_blockwise" and model[0].numerics == "triton"  # same bits, the fast way
    assert backends.resolve("triton") == "fp8_blockwise"  # the former name of that pairing
    model = fp4train.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4", backend="triton")
    assert model[0].backend_name == "fp8_blockwise" and model[0].numerics == "triton"
    model = fp4train.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4", numerics="eager")  # an explicit choice wins
    assert model[0].numerics == "eager"
    model = fp4train.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4", backend="emulated")
    assert model[0].numerics == "eager"  # the emulated backend is the reference
    with pytest.raises(ValueError, match="unknown numerics 'fast'"):
        fp4train.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mxfp4", numerics="fast")


# mxfp4 (folded onto FP8 tensor cores) in every run; the other recipes, minutes of the interpreter on a CPU (nvfp4's
# BF16 split: over two), with --runslow (their layers are checked against the emulated ones in test_fp8_blockwise.py)
@pytest.mark.parametrize("recipe", ["mxfp4", *(pytest.param(r, marks=pytest.mark.slow)
                                               for r in ("nvfp4", "tib2d", "fp8_rowwise", "hadamard_mxfp4", "adahop"))])
def test_triton_backend_trains_tiny_on_the_emulated_backends_loss_curve(tmp_path, recipe, tiny_curve):
    """`tiny`, 6 steps, the same seed and data, under the `triton` backend (Triton quantization, MXFP4
    folded onto FP8 tensor cores, FP8 rowwise GEMMs) and the `emulated` reference backend: the loss at
    every step agrees within 1e-3 relative. The same operand values go in (the folds are exact; the test
    also asserts none was inexact), so on a CPU - where the FP8 GEMMs are stood in for by the
    dequantized product - the curves are equal; on a GPU only the GEMMs' summation order and output
    rounding differ (run on the H200)."""
    triton_backend = fp4train.backends.get("fp8_blockwise")
    triton_backend.operands.inexact = None  # a fresh count for this run
    if recipe == "adahop":  # calibrate over 3 steps, so that 3 of the 6 run AdaHOP's FP4 strategies
        recipe = str(tmp_path / "adahop.json")
        fp4train.recipes.get("adahop").replace(calibration_steps=3).save(recipe)
    curves = [tiny_curve(tmp_path / b, recipe, 6, DEV, backend=b, numerics=n)
              for b, n in (("emulated", "eager"), ("fp8_blockwise", "triton"))]
    assert len(curves[0]) == len(curves[1]) == 6
    assert triton_backend.operands.inexact is None or int(triton_backend.operands.inexact) == 0
    gap = max(abs(t - e) / abs(e) for e, t in zip(*curves))
    print(f"{recipe}: largest relative loss gap triton vs emulated over 6 steps: {gap:.2e}")
    if DEV == "cpu":
        assert curves[0] == curves[1]
    else:
        assert gap <= 1e-3, (recipe, curves)
