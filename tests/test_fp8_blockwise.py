"""The fp8_blockwise backend: MXFP4 operands folded into FP8 group scales, the same layer results.

On a CPU the fold kernel runs interpreted and the GEMM falls back to the emulated one on the
folded values, which equal the MXFP4 values exactly here (no group spans more than 14 binades):
the layer must equal the emulated layer bit for bit. On a GPU the GEMM is ``scaled_mm``
(blockwise FP8, another summation order): close, and the inexact count stays zero.
"""

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

import fp4train  # noqa: E402
from fp4train.backends import fp8_blockwise, get  # noqa: E402
from fp4train.backends.fp8_operands import FoldedOperand  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("recipe,rows", [*((r, 128) for r in ("mxfp4", "hadamard_mxfp4", "adahop-oe", "tib2d", "nvfp4", "fp8_rowwise")),
                                         ("mxfp4", 40), ("tib2d", 40)])  # 40: a token count off every block size
@pytest.mark.parametrize("numerics", ["eager", "triton"])
def test_fp8_blockwise_layer_matches_emulated(recipe, rows, numerics, layer_run, spec_of):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).to(DEV)
    x = torch.randn(rows, 256, device=DEV)
    x[:, 7] *= 30
    dy = torch.randn(rows, 128, device=DEV)
    backend = "fp8_blockwise"
    outs = [layer_run(lin, spec_of(recipe), x, dy, backend=b, numerics=n) for b, n in (("emulated", "eager"), (backend, numerics))]
    for a, b in zip(*outs):
        if DEV == "cpu":
            assert torch.equal(a, b)
        else:  # another summation order; where blockwise scaled_mm gives only BF16, one BF16 rounding (2**-9)
            bf16_out = backend != "emulated" and False in (fp8_blockwise._FP32_OUT, fp8_blockwise._ROWWISE_FP32_OUT)
            tol = 2**-8 if bf16_out else 1e-3  # 1e-3: FP8 tensor-core accumulation (promoted every 128 of K)
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item())
    assert int(get(backend).operands.inexact if get(backend).operands.inexact is not None else 0) == 0


def test_folded_operand_orientation():
    be = get("fp8_blockwise")
    q = fp4train.recipes.QuantSpec("mxfp4")
    w = torch.randn(128, 256, device=DEV)
    along_k = be.operands.operand(w, q, axis=1, role=1, seed=None)
    along_n = be.operands.operand(w, q, axis=0, role=1, seed=None)
    assert isinstance(along_k, FoldedOperand) and along_k.shape == (128, 256) and along_k.block_axis == 1
    assert along_n.shape == (128, 256) and along_n.block_axis == 0 and along_n.t().block_axis == 1
    for op, axis in ((along_k, 1), (along_n, 0)):
        torch.testing.assert_close(op.dequantize(), fp4train.quantize(w, "mxfp4", axis=axis).dequantize(torch.float32),
                                   rtol=0, atol=0)
    assert be.operands.operand(torch.randn(128, 96, device=DEV), q, axis=1, role=0, seed=None) is None  # K % 128: not folded


def test_saved_x_is_folded_from_its_packed_codes():
    """wgrad's B operand: X [M, K] quantized along M (packed), seen as X^T [K, M]."""
    be = get("fp8_blockwise")
    x = torch.randn(256, 128, device=DEV)
    saved = fp4train.quantize(x, "mxfp4", axis=0)
    f = be.operands.fold_saved(saved.t())
    assert isinstance(f, FoldedOperand) and f.shape == (128, 256) and f.data.group_rows == 128
    torch.testing.assert_close(f.dequantize(), saved.t().dequantize(torch.float32), rtol=0, atol=0)
    # the reference fold (eager numerics) gives the kernel's bits, for either role
    for role in (0, 1):
        k = be.operands.fold_saved(saved.t(), 1 if role == 0 else 128)
        r = be.operands.fold_reference(saved.t(), role)
        assert torch.equal(r.data.codes, k.data.codes) and torch.equal(r.data.scales, k.data.scales)
        assert r.data.group_rows == k.data.group_rows == (1 if role == 0 else 128)
    with pytest.raises(ValueError, match="only 1x32 MXFP4 blocked along the inner dim"):
        be.operands.fold_reference(saved, 1)  # blocks along dim 0 of the logical operand: not an inner-dim operand


def test_a_torch_without_blockwise_fp8_gemms_falls_back_once_with_a_warning(monkeypatch):
    from fp4train.backends import fp8_blockwise as fb

    be = get("fp8_blockwise")
    q = fp4train.recipes.QuantSpec("mxfp4")
    a = be.operands.operand(torch.randn(64, 256, device=DEV), q, axis=1, role=0, seed=None)
    b = be.operands.operand(torch.randn(128, 256, device=DEV), q, axis=1, role=1, seed=None)
    calls = []

    def unsupported(*args):
        calls.append(1)
        raise RuntimeError("scaled_mm: blockwise scaling is not supported")

    monkeypatch.setattr(fb, "blockwise_fp8_mm", unsupported)
    monkeypatch.setattr(fb.Fp8BlockwiseBackend, "_blockwise", staticmethod(lambda a, b: True))  # as if on a GPU
    monkeypatch.setattr(fb, "_BLOCKWISE_OK", None)
    ref = get("emulated").gemm(a.scaled_bf16(), b.scaled_bf16(), torch.float32)
    with pytest.warns(RuntimeWarning, match="cannot run blockwise-scaled FP8 GEMMs.*not supported.*BF16 tensor cores"):
        y = be.gemm(a, b, torch.float32)
    assert torch.equal(y, ref) and be.gemm(a, b, torch.float32).shape == (64, 128) and len(calls) == 1  # learnt once
    monkeypatch.setattr(fb, "_BLOCKWISE_OK", True)  # it ran before: a later failure is a real error
    with pytest.raises(RuntimeError, match="not supported"):
        be.gemm(a, b, torch.float32)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("role", [0, 1])
def test_32x32_tiles_fold_for_either_role_and_orientation(transposed, role):
    """tib2d's W and dY: one 32x32-tile quantization, folded for each GEMM that uses it."""
    be = get("fp8_blockwise")
    x = torch.randn(256, 384, device=DEV) * torch.logspace(-3, 3, 256, device=DEV)[:, None]
    q = fp4train.quantize(x, "mxfp4", block=(32, 32), scale="ceil")
    view = q.t() if transposed else q
    f = be.operands.fold_tiles(view, role)
    assert isinstance(f, FoldedOperand) and f.shape == view.shape and f.block_axis == 1
    assert f.data.group_rows == (1 if role == 0 else 128) and f.data.scales.shape[0] == view.shape[0] // f.data.group_rows
    torch.testing.assert_close(f.dequantize(), view.dequantize(torch.float32), rtol=0, atol=0)  # exact


@pytest.mark.parametrize("k_groups", [1, 2, 3, 4, 5, 8])
def test_blockwise_scale_b_has_the_padded_layout_scaled_mm_wants(k_groups):
    """torch 2.11's blockwise scaled_mm (H200) takes B's 128x128 scales as [round_up(K/128, 4), N/128]
    with the K-groups contiguous; before this, every layer with K/128 not a multiple of 4 failed there."""
    s = torch.rand(3, k_groups) + 0.5  # [N/128, K/128]
    got = fp8_blockwise.blockwise_scale_b(s)
    kp = -(-k_groups // 4) * 4
    assert got.shape == (kp, 3) and got.stride() == (1, kp)
    assert torch.equal(got[:k_groups], s.t())


def test_fp8_rowwise_layer_runs_its_three_gemms_as_rowwise_fp8_gemms(monkeypatch, layer_run, spec_of):
    """fp8_rowwise on the triton backend: every GEMM (fprop, dgrad, wgrad) gets two FP8 rowwise
    operands stored inner-dim last (W along N and dY / X along M included), and the result equals the
    emulated layer's. On a CPU the GEMM itself is stood in for by the dequantized product."""
    from fp4train.backends import fp8_blockwise as fb

    calls = []

    def fake_mm(a, b, out_dtype):
        assert a.codes.shape == a.shape and b.codes.shape == b.shape and a.shape[1] == b.shape[1]
        calls.append((tuple(a.shape), tuple(b.shape)))
        return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).T).to(out_dtype)

    monkeypatch.setattr(fb, "rowwise_fp8_mm", fake_mm)
    monkeypatch.setattr(fb.Fp8BlockwiseBackend, "_rowwise_pair", staticmethod(lambda a, b: fb._rowwise(a) and fb._rowwise(b)))
    monkeypatch.setattr(fb, "_ROWWISE_OK", None)
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).to(DEV)
    x, dy = torch.randn(64, 256, device=DEV), torch.randn(64, 128, device=DEV)
    got = layer_run(lin, spec_of("fp8_rowwise"), x, dy, backend="fp8_blockwise", numerics="triton")
    want = layer_run(lin, spec_of("fp8_rowwise"), x, dy, backend="emulated")
    assert sorted(calls) == sorted([((64, 256), (128, 256)), ((64, 128), (256, 128)), ((128, 64), (256, 64))])
    # the same dequantized operands; on a GPU the two FP32 products may take cuBLAS kernels that sum in
    # another order (seen on the H200: 4.5e-6 apart); a wrong operand or scale would be off by O(1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_torch_without_rowwise_fp8_gemms_falls_back_once_with_a_warning(monkeypatch):
    from fp4train.backends import fp8_blockwise as fb

    be = get("fp8_blockwise")
    a = fp4train.quantize(torch.randn(64, 256, device=DEV), "fp8", axis=1)
    b = fp4train.quantize(torch.randn(256, 128, device=DEV), "fp8", axis=0).t()  # W along N, viewed as B
    assert fb._rowwise(a) and fb._rowwise(b) and b.shape == (128, 256)

    def unsupported(*args):
        raise RuntimeError("scaled_mm: rowwise scaling is not supported")

    monkeypatch.setattr(fb, "rowwise_fp8_mm", unsupported)
    monkeypatch.setattr(fb.Fp8BlockwiseBackend, "_rowwise_pair", staticmethod(lambda a, b: True))
    monkeypatch.setattr(fb, "_ROWWISE_OK", None)
    ref = get("emulated").gemm(a, b, torch.float32)
    with pytest.warns(RuntimeWarning, match="cannot run rowwise-scaled FP8 GEMMs.*BF16 tensor cores"):
        y = be.gemm(a, b, torch.float32)
    assert torch.equal(y, ref) and fb._ROWWISE_OK is False


def test_operand_pair_gives_a_second_operand_only_in_a_role_it_can_play():
    """MXFP4's pair packs its along-M half for the layer to save and fold as a B operand (X for wgrad):
    asked for an A operand (dY for wgrad) it declines. FP8 rowwise's halves serve either role."""
    from fp4train.backends import get
    from fp4train.recipes import QuantSpec

    be = get("fp8_blockwise")
    x = torch.randn(64, 256, device=DEV)  # where the kernels run (a CPU tensor on a GPU machine has none)
    mx, f8 = QuantSpec("mxfp4"), QuantSpec("fp8")
    assert be.operands.operand_pair(x, mx, mx, seeds=(None, None)) is not None
    assert be.operands.operand_pair(x, mx, mx, seeds=(None, None), b_role=0) is None
    for role in (0, 1):
        rows, cols = be.operands.operand_pair(x, f8, f8, seeds=(None, None), b_role=role)
        assert rows.block_axis == 1 and cols.block_axis == 0


def test_backend_predicates_say_what_its_operand_methods_make():
    """Layers' operand plans decide by the backend's predicates (pair_kind / pair_fits, folds_1x32 / fuses /
    fold_fits); operand_pair and operand check the same ones, so a plan and the made operand cannot disagree:
    each predicate's False is a None."""
    from fp4train.backends import fp8_operands as ops
    from fp4train.backends import get
    from fp4train.recipes import QuantSpec, TransformSpec

    be = get("fp8_blockwise")
    mx, mx_sr, f8, f8_sr = QuantSpec("mxfp4"), QuantSpec("mxfp4", rounding="stochastic"), QuantSpec("fp8"), QuantSpec("fp8", rounding="stochastic")
    tiles, nv = QuantSpec("mxfp4", block=(32, 32)), QuantSpec("nvfp4")
    assert (ops.pair_kind(mx, mx), ops.pair_kind(mx_sr, mx), ops.pair_kind(f8, f8)) == ("mxfp4", "mxfp4", "fp8")
    assert ops.pair_kind(f8_sr, f8) is None and ops.pair_kind(mx, f8) is None and ops.pair_kind(tiles, mx) is None
    assert ops.pair_kind(nv, nv) is None
    for shape, role, fits in (((64, 256), 1, True), ((48, 256), 1, False), ((64, 192), 1, False), ((64, 256), 0, False)):
        x = torch.randn(*shape, device=DEV)
        assert ops.pair_fits("mxfp4", shape, x.dtype, role) is fits
        assert (be.operands.operand_pair(x, mx, mx, seeds=(None, None), b_role=role) is not None) is fits
    assert ops.pair_fits("fp8", (48, 96), torch.float32, 0) and not ops.pair_fits(None, (64, 256), torch.float32)
    h32, h256 = TransformSpec("hadamard", block=32), TransformSpec("hadamard", block=256)
    assert ops.fuses(mx, h32) and not ops.fuses(mx, h256) and not ops.fuses(tiles, h32) and not ops.fuses(mx, None)
    x16 = torch.randn(64, 256, dtype=torch.float16, device=DEV)
    assert ops.fold_fits((64, 256), torch.float16, 1) and not ops.fold_fits((64, 256), torch.float16, 1, h32)
    assert not ops.fold_fits((64, 96), torch.float32, 1)
    assert be.operands.operand(x16, mx, axis=1, role=0, seed=None, transform=h32) is None
    assert be.operands.operand(x16.float(), mx, axis=1, role=0, seed=None, transform=h32) is not None
    assert be.operands.operand(torch.randn(64, 96, device=DEV), mx, axis=1, role=0, seed=None) is None
