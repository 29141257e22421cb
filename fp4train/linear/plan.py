"""A quantized linear's operand plan: which implementation prepares each of its six GEMM operands, and which
GEMM multiplies them - decided once per layer configuration and call shape, executed by the layer's ops.

The six roles (``C = A B^T``, both operands blocked along the GEMM's inner dimension; shapes in
:mod:`fp4train.linear.gemms`): ``fprop.a`` (X along K), ``fprop.b`` (W along K), ``dgrad.a`` (dY along N),
``dgrad.b`` (W along N), ``wgrad.a`` (dY along M), ``wgrad.b`` (X along M). Each maps to one :class:`Prep`:

* ``"bf16"``: not quantized - cast to the compute dtype (after the GEMM's transform, if any);
* ``"reference"``, ``"compiled"``, ``"kernel"``: quantized and packed (FP4/FP8 codes + scales) by the
  plain-PyTorch reference, its compiled cores, or a Triton kernel - for operands that are kept (saved for
  the backward, or shared by two GEMMs);
* ``"values kernel"``, ``"compiled values"``: quantized and split into the BF16 values and factors the BF16
  GEMM reads, without the codes ever written - for operands multiplied at once;
* ``"fold kernel"``: MXFP4 quantized and folded into FP8 with power-of-two group scales in one pass (the FP8
  blockwise GEMM's operand), the block Hadamard fused where the plan says ``transform="fused"`` (as it is into
  NVFP4's ``"kernel"`` and ``"values kernel"`` along dim 0 under a 16-point transform);
* ``"pair kernel"``: X (or dY) read once for both of its GEMMs (MXFP4: folded along K + packed along M; FP8
  rowwise: both orientations), ``"shared X"``: that made once for every layer that reads the same X
  (:func:`fp4train.linear.op.prepare_x`);
* ``"fprop.a"``, ``"fprop.b"``, ``"dgrad.a"``: the operand another role prepared (one 2D tiling serves
  both GEMMs); ``"input"``: X as it came (wgrad unquantized, or under outlier extraction);
* ``"outliers"``: the GEMM runs AdaHOP's outlier extraction; ``residual`` prepares what is left.

A GEMM of the plan (:class:`Gemm`) names its kernel - ``"fp8 blockwise"`` (MXFP4 folded, FP8 tensor cores),
``"fp8 rowwise"``, ``"bf16 split"`` (exact BF16 values, FP32 accumulation, factors in the epilogue) or
``"fp32"`` (the emulated reference) - and how packed operands reach it (``fold``: ``"kernel"`` or
``"reference"``; ``split``/``epilogue``: ``"kernel"`` or ``"torch"``).

The choices follow the layer's configuration: the backend says which GEMMs exist (``fp8_blockwise``: FP8
tensor cores; ``emulated``: BF16 tensor cores or FP32), the numerics which implementation quantizes
(``"eager"``: the reference, no Triton kernel anywhere; ``"compiled"``: compiled cores; ``"triton"``: Triton
kernels where one covers the request). Where several implementations could serve, the fastest that gives the
reference's bits is chosen; the choice depends on the call's shape only through divisibility (a block size,
the FP8 GEMMs' 128-groups), so a run plans each layer a handful of times. ``print(layer)`` shows its plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..backends.fp8_operands import fold_fits, folds_1x32, fuses, pair_fits, pair_kind  # noqa: F401 - re-exported
from ..formats.quantize import check_request
from ..quantizer import fuses_hadamard, hadamard_impl, quantize_impl, values_impl
from ..recipes.spec import GemmSpec, LinearSpec, QuantSpec, TransformSpec
from .layer_config import parse

ROLES = ("fprop.a", "fprop.b", "dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b")
GEMMS = ("fprop", "dgrad", "wgrad")

#: how a kept (packed) operand can be made, and how one multiplied at once can be
PACKED = ("reference", "compiled", "kernel")
IMMEDIATE = ("values kernel", "compiled values", "fold kernel")


@dataclass(frozen=True)
class Prep:
    """How one operand is prepared: ``how`` (see the module docstring) and, where its GEMM has an inner
    Hadamard transform, how that runs (``"kernel"``, ``"compiled"``, ``"reference"``, or ``"fused"`` into
    the quantization pass). ``residual``: the preparation of an outlier-extraction GEMM's residual."""

    how: str
    transform: str | None = None
    residual: Prep | None = None

    def __str__(self) -> str:
        if self.how == "outliers":
            return f"outlier extraction, residual: {self.residual}"
        if self.transform == "fused":
            return f"{self.how} (Hadamard fused)"
        return self.how + (f" after the Hadamard {self.transform}" if self.transform else "")


@dataclass(frozen=True)
class Gemm:
    """The GEMM that multiplies a pair of prepared operands (see the module docstring)."""

    kind: str
    residual: Gemm | None = None  # an outlier-extraction GEMM's: the GEMM of the residual
    fold: str | None = None  # packed MXFP4 operands folded for the FP8 GEMM by the "kernel" or the "reference"
    #: bf16 split: packed operands split into BF16 values, and the output's factors applied, by Triton kernels (else
    #: by PyTorch ops: the same bits)
    kernels: bool = False

    def __str__(self) -> str:
        if self.residual is not None:
            return f"{self.kind}, residual: {self.residual}"
        extra = [f"fold: {self.fold}"] if self.fold else []
        extra += [f"split and epilogue: {'kernel' if self.kernels else 'torch'}"] if self.kind == "bf16 split" else []
        return self.kind + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class OperandPlan:
    """Each role's :class:`Prep`, each GEMM's :class:`Gemm`, and what forward keeps for backward."""

    preps: dict = field(hash=False, compare=True)  # role -> Prep
    gemms: dict = field(hash=False, compare=True)  # gemm -> Gemm
    shared_x: str | None = None  # the shared preparation of X ("mxfp4" pair, "fp8" pair, "fold"), or None
    saved_x: str | None = None  # the role whose operand forward keeps for wgrad ("wgrad.b", "fprop.a"), or "input"
    saved_w: str | None = None  # "fprop.b" where fprop's W serves dgrad, else None (dgrad prepares W)

    def __getitem__(self, role: str) -> Prep:
        return self.preps[role]

    def describe(self) -> str:
        """The plan as lines of text (``print(layer)`` shows it)."""
        lines = [f"{r}: {self.preps[r]}" for r in ROLES]
        lines += [f"{g} GEMM: {self.gemms[g]}" for g in GEMMS]
        if self.shared_x:
            lines.append(f"X shared with the layers that read it ({self.shared_x} preparation)")
        lines.append(f"saved for backward: X as {self.saved_x}" + (", W as fprop.b" if self.saved_w else ", W itself"))
        return "\n".join(lines)


@dataclass(frozen=True)
class Where:
    """What decides a plan besides the specs: the numerics, the backend's GEMMs, the device."""

    numerics: str
    fp8_gemms: bool  # the backend multiplies folded MXFP4 and FP8 rowwise on FP8 tensor cores (on CUDA)
    cuda: bool
    kernels_usable: bool  # Triton kernels can run on the device (CUDA, or the interpreter in tests)

    @property
    def kernels(self) -> bool:
        """Do Triton kernels quantize here?"""
        return self.numerics == "triton" and self.kernels_usable

    @property
    def own_operands(self) -> bool:
        """Does the FP8 backend make its operands (folded MXFP4, FP8 rowwise) with its Triton kernels here?"""
        return self.fp8_gemms and self.kernels


# ---- one operand --------------------------------------------------------------------------------------------

def _hadamard(where: Where, dtype: torch.dtype) -> str:
    """How a GEMM's inner Hadamard runs on its own (a 2D operand)."""
    return hadamard_impl(where.numerics, where.cuda, 2, dtype)


def _check(q: QuantSpec, shape: tuple, axis: int):
    """The request's ``(block, axis)``, checked as :func:`fp4train.quantize` checks it (a one-line error)."""
    kw = q.quantize_kwargs()
    meta = torch.empty(shape, device="meta")
    return check_request(meta, q.format, axis=axis, block=kw["block"], scale=kw["scale"], rounding=kw["rounding"],
                         seed=0 if q.stochastic else None, four_over_six=kw.get("four_over_six", False))


def packed(q: QuantSpec, transform: TransformSpec | None, shape: tuple, dtype: torch.dtype, axis: int,
           where: Where) -> Prep:
    """How an operand that is kept (saved for backward, or shared by two GEMMs) is made."""
    t = _hadamard(where, dtype) if transform is not None else None
    if not q.quantized:
        return Prep("bf16", t)
    block, ax = _check(q, shape, axis)
    kw = q.quantize_kwargs()
    if transform is not None and fuses_hadamard(where.numerics, where.kernels_usable, shape, dtype, q.format, kw, axis,
                                                transform.block, packed=True):
        return Prep("kernel", "fused")
    return Prep(quantize_impl(where.numerics, where.cuda, where.kernels_usable, shape, dtype, q.format, block, ax, kw["scale"],
                              kw["rounding"], q.four_over_six), t)


def immediate(q: QuantSpec, transform: TransformSpec | None, shape: tuple, dtype: torch.dtype, axis: int,
              where: Where) -> Prep:
    """How an operand that its GEMM multiplies at once is made: folded for the FP8 GEMM, as BF16 values for the
    BF16 GEMM, or packed where neither has an implementation here."""
    if not q.quantized or len(shape) != 2:
        return packed(q, transform, shape, dtype, axis, where)
    if where.own_operands:
        if transform is not None and fuses(q, transform) and fold_fits(shape, dtype, axis, transform):
            return Prep("fold kernel", "fused")
        t = _hadamard(where, dtype) if transform is not None else None
        if q.format == "fp8" and not q.stochastic and packed(q, None, shape, dtype, axis, where).how == "kernel":
            return Prep("kernel", t)  # E4M3 codes + row scales: the rowwise-scaled FP8 GEMM's operand
        if q.format == "mxfp4" and not q.four_over_six:
            if q.is_2d and tuple(q.block) == (32, 32) and shape[0] % 128 == 0 and shape[1] % 128 == 0:
                return Prep("kernel", t)  # 32x32 tiles, packed: folded for each GEMM that reads them
            if folds_1x32(q) and fold_fits(shape, dtype, axis):
                return Prep("fold kernel", t)
    elif where.fp8_gemms and where.cuda and (folds_1x32(q) and fold_fits(shape, dtype, axis)
                                             or q.format == "fp8" and not q.stochastic):
        # packed by the quantizer, then multiplied on FP8 tensor cores (MXFP4 folded by the reference)
        return packed(q, transform, shape, dtype, axis, where)
    if transform is not None and fuses_hadamard(where.numerics, where.kernels_usable, shape, dtype, q.format,
                                                q.quantize_kwargs(), axis, transform.block, packed=False):
        return Prep("values kernel", "fused")
    how = values_impl(where.numerics, where.cuda, where.kernels_usable, shape, dtype, q.format, q.quantize_kwargs(), axis)
    if how is not None:
        return Prep(how, _hadamard(where, dtype) if transform is not None else None)
    return packed(q, transform, shape, dtype, axis, where)


def with_outliers(g: GemmSpec, shapes: tuple, dtypes: tuple, where: Where) -> tuple[Prep, Prep]:
    """The two roles of a GEMM that runs AdaHOP's outlier extraction (its operands ``[outer, inner]``)."""
    return tuple(Prep("outliers", residual=immediate(q, g.transform, s, d, 1, where))
                 for q, s, d in zip((g.a, g.b), shapes, dtypes))


# ---- what forward keeps -------------------------------------------------------------------------------------

def shares_quantization(p: QuantSpec, tp: TransformSpec | None, q: QuantSpec, tq: TransformSpec | None) -> bool:
    """Can one quantization of a tensor serve two GEMMs that block it along different axes?

    Only with identical 2D tiles and no transform: a tile maps onto a tile under transposition
    (arXiv 2607.24953), while a 1D block or a one-axis transform does not.
    """
    return p.quantized and p.is_2d and p == q and tp is None and tq is None


def saved_x_source(spec: LinearSpec) -> str:
    """Where the X saved for wgrad comes from: ``"input"`` (X itself: outlier extraction in wgrad picks rows of X
    and dY together, or wgrad's X is unquantized), ``"fprop.a"`` (one 2D tiling serves both GEMMs, kept packed)
    or ``"wgrad.b"`` (X quantized along M in forward, kept packed)."""
    g, w3 = spec.fprop, spec.wgrad
    if w3.outliers is not None or (not w3.b.quantized and w3.transform is None):
        return "input"
    if g.outliers is None and shares_quantization(g.a, g.transform, w3.b, w3.transform):
        return "fprop.a"
    return "wgrad.b"


def saves_fprop_w(spec: LinearSpec) -> bool:
    """Does fprop's prepared W serve dgrad as well (one 2D tiling of W for GEMMs 1 and 2)?"""
    g, g2 = spec.fprop, spec.dgrad
    return g.outliers is None and g2.outliers is None and shares_quantization(g.b, g.transform, g2.b, g2.transform)


def shares_dy(spec: LinearSpec) -> bool:
    """Does dgrad's prepared dY serve wgrad as well (one 2D tiling)?"""
    g2, g3 = spec.dgrad, spec.wgrad
    return g2.outliers is None and g3.outliers is None and shares_quantization(g2.a, g2.transform, g3.a, g3.transform)


def deterministic(q: QuantSpec, transform: TransformSpec | None) -> bool:
    """Does preparing an operand with ``q`` and ``transform`` depend on its values alone (no stochastic rounding,
    no random signs)? Then layers reading the same X may share it (:func:`shared_x_kind`)."""
    return not (q.quantized and q.stochastic) and (transform is None or not transform.random_signs)


def shared_x_kind(spec: LinearSpec, fp8_gemms: bool, numerics: str) -> str | None:
    """Which shared preparation of X this layer's specs allow (``"mxfp4"``/``"fp8"`` pair, ``"fold"``), or None
    (X is then prepared inside the layer's own op). Shared preparations are deterministic (nearest rounding, no
    random signs), have wgrad's X saved packed, and are made by the FP8 backend's Triton kernels."""
    g, w3 = spec.fprop, spec.wgrad
    if not fp8_gemms or numerics != "triton" or saved_x_source(spec) != "wgrad.b":
        return None
    if g.outliers is not None or w3.outliers is not None:
        return None
    if not (g.a.quantized and w3.b.quantized and deterministic(g.a, g.transform) and deterministic(w3.b, w3.transform)):
        return None
    pair = pair_kind(g.a, w3.b) if g.transform is None and w3.transform is None else None
    if pair is not None:
        return pair
    if folds_1x32(g.a) and folds_1x32(w3.b) and (g.transform is None or fuses(g.a, g.transform)):
        return "fold"
    return None


def shared_x_fits(kind: str | None, shape: tuple, dtype: torch.dtype, transform: TransformSpec | None) -> bool:
    """Does X of ``shape`` and ``dtype`` allow the shared preparation ``kind`` (whose kernels can run on its device)?"""
    if kind == "fold":
        return fold_fits(shape, dtype, -1, transform)
    return pair_fits(kind, shape, dtype)


def pad_to(m: int, transform: TransformSpec | None) -> int:
    """M zero-padded to the wgrad transform's block (exact: zero rows add nothing to ``dY^T X``)."""
    return m + (-m % transform.block) if transform is not None else m


# ---- the GEMMs ----------------------------------------------------------------------------------------------

def _form(prep: Prep, q: QuantSpec, inner: int, outer: int) -> str:
    """What an operand is when it reaches its GEMM: "folded", "tiles" (packed 32x32 MXFP4, both dims % 128),
    "mx1x32" (packed 1x32 MXFP4 along the inner dim, a multiple of 128), "fp8", "values" or "other"."""
    if prep.how == "fold kernel":
        return "folded"
    if prep.how in ("bf16", "input"):
        return "bf16"
    if prep.how in ("pair kernel", "shared X"):
        return "folded" if q.format == "mxfp4" else "fp8"
    if prep.how in IMMEDIATE:
        return "values"
    if q.quantized and q.format == "mxfp4" and not q.four_over_six:
        if q.is_2d:
            return "tiles" if tuple(q.block) == (32, 32) and inner % 128 == 0 and outer % 128 == 0 else "other"
        return "mx1x32" if inner % 128 == 0 else "other"
    if q.quantized and q.format == "fp8":
        return "fp8"
    return "other"


def gemm(a: tuple, b: tuple, inner: int, where: Where) -> Gemm:
    """The GEMM for operands ``a`` and ``b``, each ``(prep, spec, outer size)``, multiplied along ``inner``."""
    (pa, qa, outer_a), (pb, qb, outer_b) = a, b
    if pa.how == "outliers":
        return Gemm("outlier extraction", residual=gemm((pa.residual, qa, outer_a), (pb.residual, qb, outer_b), inner, where))
    if not where.cuda:
        return Gemm("fp32")
    fa, fb = _form(pa, qa, inner, outer_a), _form(pb, qb, inner, outer_b)
    if where.fp8_gemms:
        fold = "kernel" if where.kernels else "reference"
        a_folds = fa == "folded" or (fa == "tiles" and where.kernels) or (fa == "mx1x32" and not where.kernels)
        b_folds = fb == "folded" or (fb == "tiles" and where.kernels) or fb == "mx1x32"
        if a_folds and b_folds:
            needs_fold = fa != "folded" or fb != "folded"
            return Gemm("fp8 blockwise", fold=fold if needs_fold else None)
        if fa == fb == "fp8" and inner % 16 == 0 and outer_b % 16 == 0:
            return Gemm("fp8 rowwise")
    return Gemm("bf16 split", kernels=where.kernels)


# ---- the plan -----------------------------------------------------------------------------------------------

def make_plan(spec: LinearSpec, where: Where, m: int, k: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
              dy_dtype: torch.dtype, save_x: bool = True, save_w: bool = True, x_shared: bool = True) -> OperandPlan:
    """The plan of a layer with ``spec`` for X ``[m, k]`` and W ``[n, k]``, where ``where`` says; ``save_x``/``save_w``:
    whether W's and X's gradients are asked for (a call without them plans no pass that serves only them);
    ``x_shared``: X comes prepared by the shared op where the layer has one (the module decides per call: a
    shape the shared kernels do not take, or a direct call of the layer's op, prepares X inside)."""
    g, g2, g3 = spec.fprop, spec.dgrad, spec.wgrad
    preps: dict[str, Prep] = {}
    source = saved_x_source(spec)
    keep_w = saves_fprop_w(spec)
    share_dy = shares_dy(spec)
    shared = shared_x_kind(spec, where.fp8_gemms, where.numerics) if save_x and x_shared else None
    if shared is not None and not (where.kernels_usable and shared_x_fits(shared, (m, k), x_dtype, g.transform)):
        shared = None
    mp = pad_to(m, g3.transform)

    # fprop
    if g.outliers is not None:
        preps["fprop.a"], preps["fprop.b"] = with_outliers(g, ((m, k), (n, k)), (x_dtype, w_dtype), where)
    else:
        x_pair = (where.own_operands and save_x and source == "wgrad.b" and g3.outliers is None and g.transform is None
                  and g3.transform is None and (kind := pair_kind(g.a, g3.b)) is not None
                  and pair_fits(kind, (m, k), x_dtype))
        if shared is not None:
            preps["fprop.a"] = Prep("shared X")
        elif x_pair:
            preps["fprop.a"] = Prep("pair kernel")
        elif source == "fprop.a":
            preps["fprop.a"] = packed(g.a, g.transform, (m, k), x_dtype, 1, where)
        else:
            preps["fprop.a"] = immediate(g.a, g.transform, (m, k), x_dtype, 1, where)
        prep_w = packed if keep_w else immediate
        preps["fprop.b"] = prep_w(g.b, g.transform, (n, k), w_dtype, 1, where)

    # what forward keeps of X for wgrad (under outlier extraction: X itself, its preparation the GEMM's own, below)
    if source == "input" and g3.outliers is None:
        preps["wgrad.b"] = Prep("input")
    elif source == "fprop.a":
        preps["wgrad.b"] = Prep("fprop.a")
    elif preps["fprop.a"].how in ("shared X", "pair kernel"):
        preps["wgrad.b"] = preps["fprop.a"]
    elif source == "wgrad.b":
        preps["wgrad.b"] = packed(g3.b, g3.transform, (mp, k), x_dtype, 0, where)

    # dgrad, and dY for wgrad
    dy_pair = (where.own_operands and save_x and save_w and not share_dy and g2.outliers is None and g3.outliers is None and g2.transform is None
               and g3.transform is None and (kind := pair_kind(g2.a, g3.a)) is not None
               and pair_fits(kind, (m, n), dy_dtype, b_role=0))
    if g2.outliers is not None:
        preps["dgrad.a"], preps["dgrad.b"] = with_outliers(g2, ((m, n), (k, n)), (dy_dtype, w_dtype), where)
    else:
        preps["dgrad.a"] = Prep("pair kernel") if dy_pair else immediate(g2.a, g2.transform, (m, n), dy_dtype, 1, where)
        preps["dgrad.b"] = Prep("fprop.b") if keep_w else immediate(g2.b, g2.transform, (n, k), w_dtype, 0, where)
    if g3.outliers is not None:
        preps["wgrad.a"], preps["wgrad.b"] = with_outliers(g3, ((n, mp), (k, mp)), (dy_dtype, x_dtype), where)
    elif share_dy:
        preps["wgrad.a"] = Prep("dgrad.a")
    elif dy_pair:
        preps["wgrad.a"] = Prep("pair kernel")
    else:
        preps["wgrad.a"] = immediate(g3.a, g3.transform, (mp, n), dy_dtype, 0, where)

    def operand(role: str, q: QuantSpec, outer: int):
        prep = preps[role]
        if prep.how in ROLES:  # another role's operand
            prep = preps[prep.how]
        return prep, q, outer

    gemms = {
        "fprop": gemm(operand("fprop.a", g.a, m), operand("fprop.b", g.b, n), k, where),
        "dgrad": gemm(operand("dgrad.a", g2.a, m), operand("dgrad.b", g2.b, k), n, where),
        "wgrad": gemm(operand("wgrad.a", g3.a, n), _wgrad_x(preps["wgrad.b"], g3.b, k), mp, where),
    }
    return OperandPlan(preps, gemms, shared, source, "fprop.b" if keep_w else None)


def _wgrad_x(prep: Prep, q: QuantSpec, k: int):
    """wgrad's X as its GEMM sees it: what forward kept, packed (a pair's or the shared preparation's along-M half
    is packed MXFP4/FP8, as a kept operand is)."""
    if prep.how in ("shared X", "pair kernel"):
        return Prep("kernel"), q, k
    return prep, q, k


@functools.lru_cache(maxsize=4096)  # one entry per (layer kind, call shape, device): a bounded set in a run
def plan_for(config: str, m: int, k: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, dy_dtype: torch.dtype,
             cuda: bool, kernels_usable: bool, save_x: bool = True, save_w: bool = True, x_shared: bool = False) -> OperandPlan:
    """The plan of the layer that ``config`` (:func:`fp4train.linear.op.config_key`) names, for a call's shapes and
    device - what the ops execute (memoized: decided once)."""
    cfg = parse(config)
    where = Where(cfg.numerics, cfg.backend.fp8_gemms, cuda, kernels_usable)
    return make_plan(cfg.spec, where, m, k, n, x_dtype, w_dtype, dy_dtype, save_x, save_w, x_shared)
