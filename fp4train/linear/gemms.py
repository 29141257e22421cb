"""The quantized linear's three GEMMs and six prepared operands, as functions of a :class:`LinearSpec`.

Shapes: X [M, K] (M = all leading dims flattened), W [N, K], Y and dY [M, N].
Each GEMM is ``C = A B^T`` with both operands blocked along the inner dimension:

* GEMM 1, fprop: ``Y[M,N]  = X[M,K]    @ W[N,K]^T``    inner K: X along K, W along K.
* GEMM 2, dgrad: ``dX[M,K] = dY[M,N]   @ (W^T)[K,N]^T`` inner N: dY along N, W along N.
* GEMM 3, wgrad: ``dW[N,K] = dY^T[N,M] @ (X^T)[K,M]^T`` inner M: dY along M, X along M.

A GEMM's transform (Hadamard along its inner dim) is applied to both of its operands
before quantization, with the same signs. If the wgrad GEMM has one, M is zero-padded to
its block (exact: zero rows add nothing to ``dY^T X``).

What forward keeps for backward:

* X *already prepared for wgrad*: quantized along M (and transformed) in forward, kept
  packed - FP4 codes + scales, ~3.8x (MXFP4) / ~3.6x (NVFP4) fewer bytes than BF16. When
  fprop's X and wgrad's X are the same 2D-tiled quantization, fprop's is kept instead.
  X is kept unpacked only where the recipe leaves wgrad's X unquantized (``bf16``
  recipe, or custom recipes), and at 1 byte/element for FP8 recipes.
* W: the parameter itself (no copy). dgrad requantizes it along N in backward, except
  when fprop and dgrad share one 2D-tiled quantization, which is then kept (packed).
* dY is quantized once for both backward GEMMs when they share a 2D-tiled spec.

A GEMM with ``outliers`` (AdaHOP's outlier extraction) runs
:func:`~fp4train.linear.outlier_linear.gemm_with_outliers` on the high-precision operands instead:
FOID-picked rows/inner channels in high precision, the residual prepared as above. Its X
for wgrad is kept unpacked (the extraction picks rows of X and dY together in backward).

The bias gradient is ``dY.sum(0)`` in FP32. ``seed`` drives stochastic rounding and
random Hadamard signs of this call (see :func:`fp4train.linear.operands.prepare`).
:mod:`fp4train.linear.op` runs these functions as the layer's ``torch.library`` ops.
"""

from __future__ import annotations

import torch

from ..backends import multiply
from ..quantizer import Quantizer
from ..recipes.spec import LinearSpec
from .operands import DGRAD, FPROP, OP_A, OP_B, WGRAD, pad_rows, prepare, prepare_now, shares_quantization, sr_seed
from .outlier_linear import gemm_with_outliers


def deterministic(q, transform) -> bool:
    """Does preparing an operand with ``q`` and ``transform`` depend on its values alone (no
    stochastic rounding, no random signs)? Then layers reading the same X may share it (``prepare_x``)."""
    return not (q.quantized and q.stochastic) and (transform is None or not transform.random_signs)


def fprop(x2, weight, bias, spec: LinearSpec, backend, quantizer: Quantizer, seed: int, out_dtype: torch.dtype, *,
          save_x: bool = False, x_prepared=None):
    """GEMM 1, fprop: ``Y[M,N] = X[M,K] @ W[N,K]^T (+ b)``, both operands along K.

    Returns ``(Y, xa, wb, x_wgrad)``: the two prepared operands (the caller may keep them for
    backward) and, with ``save_x``, X prepared for wgrad where a backend's ``operands.operand_pair`` made
    it in the same pass as fprop's (else None). Also the whole forward of the layer when no
    gradient is needed (inference, evaluation). ``x_prepared``: ``(fprop's X, wgrad's X)`` made
    beforehand (the shared preparation of :func:`fp4train.linear.op.prepare_x`), used as they are.
    """
    g = spec.fprop
    if g.outliers is not None:  # AdaHOP outlier extraction: nothing prepared to reuse
        y = gemm_with_outliers(x2, weight, g, seed=seed, gemm=FPROP, compute_dtype=out_dtype, backend=backend, quantizer=quantizer,
                      out_dtype=out_dtype)
        return (y + bias.to(out_dtype) if bias is not None else y), None, None, None
    # an operand that backward reuses (one 2D tiling shared with another GEMM) is kept packed
    keep_x = saved_x_source(spec) == X_FPROP
    keep_w = saves_fprop_w(spec)
    common = dict(axis=1, transform=g.transform, seed=seed, gemm=FPROP, compute_dtype=out_dtype, quantizer=quantizer)
    xa = x_saved = None
    pair = backend.operands.operand_pair if backend.operands is not None else None
    if x_prepared is not None:
        xa, x_saved = x_prepared
    elif (save_x and pair is not None and not keep_x and spec.wgrad.outliers is None and g.transform is None
          and spec.wgrad.transform is None):
        # X read once for fprop (along K) and wgrad (along M), where the backend can
        seeds = (sr_seed(g.a, seed, FPROP, OP_A), sr_seed(spec.wgrad.b, seed, WGRAD, OP_B))
        if (both := pair(x2, g.a, spec.wgrad.b, seeds=seeds)) is not None:
            xa, x_saved = both
    if xa is None:
        xa = prepare(x2, g.a, operand=OP_A, **common) if keep_x else prepare_now(x2, g.a, operand=OP_A, backend=backend, **common)
    if keep_w:
        wb = prepare(weight, g.b, operand=OP_B, **common)
    else:
        wb = prepare_now(weight, g.b, operand=OP_B, backend=backend, **common)
    y = multiply(backend, xa, wb, out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y, xa, wb, x_saved


#: where the X that wgrad (GEMM 3) multiplies comes from - decided by the spec alone
X_INPUT = "input"  # X itself: AdaHOP outlier extraction in wgrad picks rows of X and dY together, or wgrad's X is unquantized
X_FPROP = "fprop"  # fprop's X: one 2D tiling serves both GEMMs (saved packed)
X_WGRAD = "wgrad"  # X quantized along M for wgrad in forward (saved packed; the backend may make it in fprop's pass)


def saved_x_source(spec: LinearSpec) -> str:
    """Where the X saved for wgrad comes from: :data:`X_INPUT`, :data:`X_FPROP` or :data:`X_WGRAD`."""
    g, w3 = spec.fprop, spec.wgrad
    if w3.outliers is not None or (not w3.b.quantized and w3.transform is None):
        return X_INPUT
    if g.outliers is None and shares_quantization(g.a, g.transform, w3.b, w3.transform):
        return X_FPROP
    return X_WGRAD


def saves_fprop_w(spec: LinearSpec) -> bool:
    """Does fprop's prepared W serve dgrad as well (one 2D tiling of W for GEMMs 1 and 2)?"""
    g, g2 = spec.fprop, spec.dgrad
    return g.outliers is None and g2.outliers is None and shares_quantization(g.b, g.transform, g2.b, g2.transform)


def x_from_input(x2: torch.Tensor, spec: LinearSpec, cdt: torch.dtype) -> torch.Tensor:
    """wgrad's X where :func:`saved_x_source` is :data:`X_INPUT`: X as it came (outlier extraction
    picks from it), or cast to the compute dtype (wgrad's X unquantized)."""
    return x2 if spec.wgrad.outliers is not None else x2.to(cdt)


def forward(x2, weight, bias, spec: LinearSpec, backend, quantizer: Quantizer, seed: int, out_dtype: torch.dtype, *,
            save_x: bool, save_w: bool, x_prepared=None):
    """The layer's forward on ``X[M, K]``: ``(Y, x_saved, w_saved)`` - Y and what backward needs
    besides W: with ``save_x`` (W wants a gradient) X prepared for wgrad, with ``save_w`` (X wants
    a gradient) W prepared for dgrad where fprop's serves (else None: dgrad prepares W itself)."""
    cdt = out_dtype
    y, xa, wb, x_made = fprop(x2, weight, bias, spec, backend, quantizer, seed, out_dtype, save_x=save_x, x_prepared=x_prepared)
    x_saved = w_saved = None
    if save_x:
        source, w3 = saved_x_source(spec), spec.wgrad
        if x_made is not None:
            x_saved = x_made  # made with fprop's X (one pass, or given)
        elif source == X_INPUT:
            x_saved = x_from_input(x2, spec, cdt)
        elif source == X_FPROP:
            x_saved = xa
        else:
            xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
            x_saved = prepare(xm, w3.b, axis=0, transform=w3.transform, seed=seed, gemm=WGRAD, operand=OP_B, compute_dtype=cdt,
                              quantizer=quantizer)
    if save_w and saves_fprop_w(spec):
        w_saved = wb  # one 2D tiling of W serves GEMM 2 (dgrad) as well
    return y, x_saved, w_saved


def backward(dy2, weight, x_op, w_q, spec: LinearSpec, backend, quantizer: Quantizer, seed: int, cdt: torch.dtype,
             x_dtype: torch.dtype, needs: tuple[bool, bool, bool]):
    """The layer's backward from ``dY[M, N]``: ``(dX[M, K], dW, db)``, each None unless ``needs``
    asks for it (X, W, bias). ``x_op``: X as :func:`forward` saved it for wgrad; ``w_q``: W as
    forward saved it for dgrad, or None (prepared here)."""
    g2, g3 = spec.dgrad, spec.wgrad
    common = dict(seed=seed, compute_dtype=cdt, quantizer=quantizer, backend=backend)
    share_dy = g2.outliers is None and g3.outliers is None and shares_quantization(g2.a, g2.transform, g3.a, g3.transform)
    dx = dw = db = None
    dy_dgrad = dy_wgrad = None
    pair = backend.operands.operand_pair if backend.operands is not None else None
    if (needs[0] and needs[1] and pair is not None and not share_dy and g2.outliers is None and g3.outliers is None
            and g2.transform is None and g3.transform is None):
        # dY for dgrad (along N) and wgrad (along M, an A operand there) in one go, where the backend can
        both = pair(dy2, g2.a, g3.a, seeds=(sr_seed(g2.a, seed, DGRAD, OP_A), sr_seed(g3.a, seed, WGRAD, OP_A)), b_role=OP_A)
        if both is not None:
            dy_dgrad, dy_wgrad = both
    if dy_dgrad is None and ((needs[0] and g2.outliers is None) or share_dy):
        dy_dgrad = prepare_now(dy2, g2.a, axis=1, transform=g2.transform, gemm=DGRAD, operand=OP_A, **common)
    if needs[0] and g2.outliers is not None:
        dx = gemm_with_outliers(dy2, weight.t(), g2, gemm=DGRAD, out_dtype=x_dtype, **common)
    elif needs[0]:
        # GEMM 2, dgrad: dX[M,K] = dY[M,N] @ (W^T)[K,N]^T, both along N
        if w_q is None:
            w_q = prepare_now(weight, g2.b, axis=0, transform=g2.transform, gemm=DGRAD, operand=OP_B, **common)
        dx = multiply(backend, dy_dgrad, w_q.t(), x_dtype)
    if needs[1] and g3.outliers is not None:
        mult = g3.transform.block if g3.transform is not None else 1
        dw = gemm_with_outliers(pad_rows(dy2, mult).t(), pad_rows(x_op, mult).t(), g3, gemm=WGRAD, out_dtype=weight.dtype, **common)
    elif needs[1]:
        # GEMM 3, wgrad: dW[N,K] = dY^T[N,M] @ (X^T)[K,M]^T, both along M
        if share_dy:
            dy_wgrad = dy_dgrad
        elif dy_wgrad is None:
            dym = pad_rows(dy2, g3.transform.block) if g3.transform is not None else dy2
            dy_wgrad = prepare_now(dym, g3.a, axis=0, transform=g3.transform, gemm=WGRAD, operand=OP_A, **common)
        dw = multiply(backend, dy_wgrad.t(), x_op.t(), weight.dtype)
    if needs[2]:
        db = dy2.float().sum(0).to(weight.dtype)
    return dx, dw, db
