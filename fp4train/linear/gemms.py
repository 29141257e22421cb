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
Which implementation prepares each operand and which GEMM multiplies them is the layer's
operand plan (:mod:`fp4train.linear.plan`): these functions execute it and decide nothing.
:mod:`fp4train.linear.op` runs them as the layer's ``torch.library`` ops.
"""

from __future__ import annotations

import torch

from ..backends import multiply
from ..recipes.spec import LinearSpec
from .operands import DGRAD, FPROP, OP_A, OP_B, WGRAD, make, pad_rows, sr_seed
from .outlier_linear import gemm_with_outliers
from .plan import OperandPlan, deterministic, saved_x_source, saves_fprop_w  # noqa: F401 - re-exported

#: where the X that wgrad (GEMM 3) multiplies comes from (:func:`fp4train.linear.plan.saved_x_source`)
X_INPUT, X_FPROP, X_WGRAD = "input", "fprop.a", "wgrad.b"


def x_from_input(x2: torch.Tensor, spec: LinearSpec, cdt: torch.dtype) -> torch.Tensor:
    """wgrad's X where the plan saves X itself: X as it came (outlier extraction picks from it), or cast to the
    compute dtype (wgrad's X unquantized)."""
    return x2 if spec.wgrad.outliers is not None else x2.to(cdt)


def fprop_operands(x2, weight, spec: LinearSpec, plan: OperandPlan, backend, seed: int, out_dtype: torch.dtype, *,
                   save_x: bool = False, x_prepared=None):
    """fprop's two operands as the plan prepares them (a GEMM without outlier extraction): ``(xa, wb, x_wgrad)``,
    ``x_wgrad`` X prepared for wgrad where the plan reads X once for both GEMMs (``"pair kernel"``) or it came
    prepared (``"shared X"``), else None."""
    g = spec.fprop
    common = dict(seed=seed, gemm=FPROP, compute_dtype=out_dtype, operands=backend.operands, transform=g.transform)
    x_saved = None
    how_x = plan["fprop.a"].how
    if how_x == "shared X":
        if x_prepared is None:
            raise RuntimeError("fp4train: the layer's plan shares X's preparation, but none came with the call")
        xa, x_saved = x_prepared
    elif how_x == "pair kernel" and save_x:
        seeds = (sr_seed(g.a, seed, FPROP, OP_A), sr_seed(spec.wgrad.b, seed, WGRAD, OP_B))
        xa, x_saved = backend.operands.operand_pair(x2, g.a, spec.wgrad.b, seeds=seeds)
    else:
        xa = make(x2, plan["fprop.a"], g.a, axis=1, operand=OP_A, **common)
    wb = make(weight, plan["fprop.b"], g.b, axis=1, operand=OP_B, **common)
    return xa, wb, x_saved


def fprop(x2, weight, bias, spec: LinearSpec, plan: OperandPlan, backend, seed: int, out_dtype: torch.dtype, *,
          save_x: bool = False, x_prepared=None):
    """GEMM 1, fprop: ``Y[M,N] = X[M,K] @ W[N,K]^T (+ b)``, both operands along K.

    Returns ``(Y, xa, wb, x_wgrad)``: the two prepared operands (the caller may keep them for
    backward) and, where the plan reads X once for both GEMMs (``"pair kernel"``), X prepared for wgrad
    (else None). Also the whole forward of the layer when no gradient is needed (inference, evaluation).
    ``x_prepared``: ``(fprop's X, wgrad's X)`` made beforehand (the plan's ``"shared X"``,
    :func:`fp4train.linear.op.prepare_x`), used as they are.
    """
    g = spec.fprop
    if g.outliers is not None:  # AdaHOP outlier extraction: nothing prepared to reuse
        y = gemm_with_outliers(x2, weight, g, (plan["fprop.a"].residual, plan["fprop.b"].residual), plan.gemms["fprop"],
                               backend=backend, out_dtype=out_dtype, seed=seed, gemm=FPROP, compute_dtype=out_dtype,
                               operands=backend.operands)
        return (y + bias.to(out_dtype) if bias is not None else y), None, None, None
    xa, wb, x_saved = fprop_operands(x2, weight, spec, plan, backend, seed, out_dtype, save_x=save_x, x_prepared=x_prepared)
    y = multiply(backend, xa, wb, out_dtype, plan.gemms["fprop"])
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y, xa, wb, x_saved


def saved_operands(x2, xa, wb, x_made, spec: LinearSpec, plan: OperandPlan, backend, seed: int, cdt: torch.dtype, *,
                   save_x: bool, save_w: bool):
    """What forward keeps for backward besides W, from fprop's prepared operands (:func:`fprop`'s ``xa``, ``wb``,
    ``x_wgrad``): ``(x_saved, w_saved)`` - with ``save_x`` X prepared for wgrad, with ``save_w`` W prepared for
    dgrad where fprop's serves (else None: dgrad prepares W itself)."""
    x_saved = w_saved = None
    if save_x:
        w3 = spec.wgrad
        if x_made is not None:
            x_saved = x_made  # made with fprop's X (one pass, or given)
        elif plan.saved_x == X_INPUT:
            x_saved = x_from_input(x2, spec, cdt)
        elif plan.saved_x == X_FPROP:
            x_saved = xa
        else:
            xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
            x_saved = make(xm, plan["wgrad.b"], w3.b, axis=0, transform=w3.transform, seed=seed, gemm=WGRAD, operand=OP_B,
                           compute_dtype=cdt, operands=backend.operands)
    if save_w and plan.saved_w is not None:
        w_saved = wb  # one 2D tiling of W serves GEMM 2 (dgrad) as well
    return x_saved, w_saved


def forward(x2, weight, bias, spec: LinearSpec, plan: OperandPlan, backend, seed: int, out_dtype: torch.dtype, *,
            save_x: bool, save_w: bool, x_prepared=None):
    """The layer's forward on ``X[M, K]``: ``(Y, x_saved, w_saved)`` - Y and what backward needs
    besides W (:func:`saved_operands`)."""
    y, xa, wb, x_made = fprop(x2, weight, bias, spec, plan, backend, seed, out_dtype, save_x=save_x, x_prepared=x_prepared)
    x_saved, w_saved = saved_operands(x2, xa, wb, x_made, spec, plan, backend, seed, out_dtype, save_x=save_x, save_w=save_w)
    return y, x_saved, w_saved


def backward_operands(dy2, weight, w_q, spec: LinearSpec, plan: OperandPlan, backend, seed: int, cdt: torch.dtype,
                      needs: tuple[bool, bool, bool]):
    """dY prepared for dgrad, W for dgrad and dY for wgrad, as the plan says: ``(dy_dgrad, w_q, dy_wgrad)``, each None
    where ``needs`` does not ask for its GEMM's gradient (X, W) or that GEMM runs outlier extraction. ``w_q``: W as
    forward saved it for dgrad, or None (prepared here)."""
    g2, g3 = spec.dgrad, spec.wgrad
    common = dict(seed=seed, compute_dtype=cdt, operands=backend.operands)
    dy_dgrad = dy_wgrad = None
    share_dy = plan["wgrad.a"].how == "dgrad.a"
    if plan["dgrad.a"].how == "pair kernel":  # planned only where both gradients are asked for
        # dY for dgrad (along N) and wgrad (along M, an A operand there) in one read
        seeds = (sr_seed(g2.a, seed, DGRAD, OP_A), sr_seed(g3.a, seed, WGRAD, OP_A))
        dy_dgrad, dy_wgrad = backend.operands.operand_pair(dy2, g2.a, g3.a, seeds=seeds, b_role=OP_A)
    if g2.outliers is None and dy_dgrad is None and (needs[0] or share_dy):
        dy_dgrad = make(dy2, plan["dgrad.a"], g2.a, axis=1, transform=g2.transform, gemm=DGRAD, operand=OP_A, **common)
    if needs[0] and g2.outliers is None and w_q is None:
        w_q = make(weight, plan["dgrad.b"], g2.b, axis=0, transform=g2.transform, gemm=DGRAD, operand=OP_B, **common)
    if needs[1] and g3.outliers is None:
        if share_dy:
            dy_wgrad = dy_dgrad
        elif dy_wgrad is None:
            dym = pad_rows(dy2, g3.transform.block) if g3.transform is not None else dy2
            dy_wgrad = make(dym, plan["wgrad.a"], g3.a, axis=0, transform=g3.transform, gemm=WGRAD, operand=OP_A, **common)
    return dy_dgrad, (w_q if needs[0] else None), dy_wgrad


def backward(dy2, weight, x_op, w_q, spec: LinearSpec, plan: OperandPlan, backend, seed: int, cdt: torch.dtype,
             x_dtype: torch.dtype, needs: tuple[bool, bool, bool]):
    """The layer's backward from ``dY[M, N]``: ``(dX[M, K], dW, db)``, each None unless ``needs``
    asks for it (X, W, bias). ``x_op``: X as :func:`forward` saved it for wgrad; ``w_q``: W as
    forward saved it for dgrad, or None (prepared here)."""
    g2, g3 = spec.dgrad, spec.wgrad
    common = dict(seed=seed, compute_dtype=cdt, operands=backend.operands)
    dx = dw = db = None
    dy_dgrad, w_q, dy_wgrad = backward_operands(dy2, weight, w_q, spec, plan, backend, seed, cdt, needs)
    if needs[0] and g2.outliers is not None:
        dx = gemm_with_outliers(dy2, weight.t(), g2, (plan["dgrad.a"].residual, plan["dgrad.b"].residual), plan.gemms["dgrad"],
                                gemm=DGRAD, backend=backend, out_dtype=x_dtype, **common)
    elif needs[0]:
        # GEMM 2, dgrad: dX[M,K] = dY[M,N] @ (W^T)[K,N]^T, both along N
        dx = multiply(backend, dy_dgrad, w_q.t(), x_dtype, plan.gemms["dgrad"])
    if needs[1] and g3.outliers is not None:
        mult = g3.transform.block if g3.transform is not None else 1
        dw = gemm_with_outliers(pad_rows(dy2, mult).t(), pad_rows(x_op, mult).t(), g3,
                                (plan["wgrad.a"].residual, plan["wgrad.b"].residual), plan.gemms["wgrad"],
                                gemm=WGRAD, backend=backend, out_dtype=weight.dtype, **common)
    elif needs[1]:
        # GEMM 3, wgrad: dW[N,K] = dY^T[N,M] @ (X^T)[K,M]^T, both along M
        dw = multiply(backend, dy_wgrad.t(), x_op.t(), weight.dtype, plan.gemms["wgrad"])
    if needs[2]:
        db = dy2.float().sum(0).to(weight.dtype)
    return dx, dw, db
