"""The quantized linear as ``torch.library`` ops: one implementation for eager calls, ``torch.compile``
(default and ``reduce-overhead``) and CUDA graphs.

* ``fp4train::quantized_linear(x, weight, bias, config, out_dtype, save_x, save_w, x_prep)`` ->
  ``[Y, seed, *saved]``: :func:`~fp4train.linear.gemms.forward`. ``seed`` is the call's
  stochastic-rounding / random-sign seed, drawn inside the op: from torch's default CPU generator (a CPU
  int64 scalar), or - for a layer converted with ``device_seeds=True`` - from the device's
  :class:`~fp4train.device_seeds.DeviceSeedStream` as an int64 ``[1]`` tensor there, which a CUDA graph
  replays with fresh draws. A spec that draws no seed outputs a zero int64 scalar on X's device (never read),
  so that no CPU tensor keeps ``reduce-overhead`` from capturing the graph. ``saved`` are the tensors of the X
  and W that backward needs, packed (FP4 codes + scales), as outputs, so the compiler's partitioner sees and
  frees them.
* ``fp4train::quantized_linear_backward(dY, weight, x, saved, seed, ...)`` -> ``[dX, dW, db]`` (those asked
  for): :func:`~fp4train.linear.gemms.backward`.
* ``fp4train::prepare_x(x, key, out_dtype)`` -> X prepared for fprop and for wgrad (``x_prep``), where the
  layer's specs make that deterministic (:func:`prep_kind`). Layers that read the same X (q/k/v, gate/up)
  share one: in a graph the compiler's common-subexpression pass merges their calls; eagerly the model's
  :class:`~fp4train.linear.shared_input.SharedInput` memo does.

Everything that is not a tensor - the spec, backend, numerics and seed source of the layer - travels as a
string, their JSON (:func:`config_key`): stable across processes, since Inductor caches compiled graphs on
disk with the ops' arguments in them. What backward needs besides tensors (the saved operands' layouts) is
derived from that config and the shapes (:func:`saved_layouts`: the reference quantization on meta tensors,
which the kernels match - checked on every forward call), never kept in a table of the process.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends
from ..counter_rng import fresh_seed
from ..device_seeds import device_seed_stream
from ..formats.fold import FoldedFP8, empty_folded
from ..formats.qtensor import QuantizedTensor
from ..formats.quantize import FORMATS, geometry, quantize_tensors
from ..quantizer import kernels_usable_on
from ..recipes.spec import GemmSpec, LinearSpec
from .layer_config import LayerConfig, config_key, parse  # noqa: F401 - re-exported
from .gemms import X_FPROP, X_INPUT, backward, forward, x_from_input
from .operands import FPROP, OP_A, OP_B, WGRAD, make, pack_operand, pad_rows, unpack_operand
from .plan import OperandPlan, plan_for, saved_x_source, saves_fprop_w, shared_x_fits, shared_x_kind


# ---- shared preparation of X ------------------------------------------------------------------------------

#: the kinds of shared X preparation: the backend's one-pass MXFP4 pair (fprop's X folded into FP8 +
#: wgrad's X packed, one read), FP8 rowwise X for both GEMMs, and MXFP4 with a block Hadamard on either
#: GEMM (fprop's X folded, the transform fused into the fold; wgrad's X transformed and packed -
#: hadamard_mxfp4, and AdaHOP's layers with an IHT). The two pair kinds are the backend's ``pair_kind`` names.
PAIR, FP8_ROWWISE, FOLD = "mxfp4", "fp8", "fold"
#: every kind's fprop operand is two tensors (FP8 codes + group scales, or E4M3 codes + row scales)
_N_XA = 2


def call_settings(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, bool, bool]:
    """What a call of the quantized linear op on ``x`` and ``weight`` takes besides them: the output dtype (autocast's
    where it is on), and whether to save X (W's gradient is asked for) and W (X's gradient is asked for)."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    grad = torch.is_grad_enabled()
    return out_dtype, grad and weight.requires_grad, grad and x.requires_grad


def prep_kind(spec: LinearSpec, backend: str, numerics: str) -> str | None:
    """Which shared X preparation this layer's specs allow, or None (X is then prepared inside the layer's own op):
    :func:`fp4train.linear.plan.shared_x_kind`."""
    return shared_x_kind(spec, backends.get(backend).fp8_gemms, numerics)


def prep_key(cfg: LayerConfig) -> str | None:
    """The key of this layer's shared X preparation: its fprop and wgrad X specs and transforms, backend and
    numerics (so layers with other W or dY specs share it too); None where :func:`prep_kind` is None."""
    if prep_kind(cfg.spec, cfg.backend_name, cfg.numerics) is None:
        return None
    g, w3 = cfg.spec.fprop, cfg.spec.wgrad
    reduced = LinearSpec(fprop=GemmSpec(a=g.a, transform=g.transform), wgrad=GemmSpec(b=w3.b, transform=w3.transform))
    return config_key(LayerConfig(reduced, cfg.backend_name, cfg.numerics))


@functools.lru_cache(maxsize=None)
def _prep_kind_of(key: str) -> str | None:
    cfg = parse(key)
    return prep_kind(cfg.spec, cfg.backend_name, cfg.numerics)


def prep_fits(x: torch.Tensor, cfg: LayerConfig) -> bool:
    """Does X's shape, dtype and device allow the layer's shared preparation (the plan's ``"shared X"``)?"""
    kind = shared_x_kind(cfg.spec, cfg.backend.fp8_gemms, cfg.numerics)  # traced by dynamo: no cache wrapper
    return kernels_usable_on(x) and shared_x_fits(kind, tuple(x.shape), x.dtype, cfg.spec.fprop.transform)


def _prep_reference(key: str, x2: torch.Tensor, out_dtype: torch.dtype):
    """``(fprop's X, wgrad's X)`` as the reference lays them out, for any tensor (fake or meta): fprop's X
    a QuantizedTensor (FP8 rowwise) or the two tensors of a folded operand."""
    cfg, kind = parse(key), _prep_kind_of(key)
    g, w3 = cfg.spec.fprop, cfg.spec.wgrad
    m, k = x2.shape
    xa = reference_layout(x2, g.a, 1, out_dtype) if kind == FP8_ROWWISE else tuple(empty_folded(m, k, 1, like=x2))
    xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
    return xa, reference_layout(xm, w3.b, 0, out_dtype)


@functools.lru_cache(maxsize=1024)  # one entry per (layer kind, token count): a bounded set in a run
def prep_layouts(key: str, shape: tuple, dtype: torch.dtype, out_dtype: torch.dtype):
    """``(fprop's X metadata, or None for a folded operand; wgrad's X metadata)`` of :func:`prepare_x`'s
    tensors for X of ``shape`` and ``dtype`` (derived on meta tensors)."""
    xa, xs = _prep_reference(key, torch.empty(shape, dtype=dtype, device="meta"), out_dtype)
    return (pack_operand(xa)[1] if isinstance(xa, QuantizedTensor) else None), pack_operand(xs)[1]


@torch.library.custom_op("fp4train::prepare_x", mutates_args=())
def prepare_x(x: torch.Tensor, key: str, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """X ``[..., K]`` prepared for fprop (along K, as the backend multiplies it) and for wgrad (along M,
    packed, as the layer saves it), by the kind :func:`prep_kind` names. Deterministic, so that layers
    reading the same X may share one call."""
    cfg, kind = parse(key), _prep_kind_of(key)
    backend = cfg.backend
    g, w3 = cfg.spec.fprop, cfg.spec.wgrad
    x2 = x.reshape(-1, x.shape[-1])
    # what the layer's plan does with X unshared (the key's spec holds only fprop's and wgrad's X), seeds unused
    plan = plan_for(key, x2.shape[0], x2.shape[1], 1, x2.dtype, x2.dtype, out_dtype, x2.is_cuda, kernels_usable_on(x2))
    if plan["fprop.a"].how == "pair kernel":
        xa, xs = backend.operands.operand_pair(x2, g.a, w3.b, seeds=(None, None))
    else:
        common = dict(seed=0, compute_dtype=out_dtype, operands=backend.operands)
        xa = make(x2, plan["fprop.a"], g.a, axis=1, transform=g.transform, gemm=FPROP, operand=OP_A, **common)
        xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
        xs = make(xm, plan["wgrad.b"], w3.b, axis=0, transform=w3.transform, gemm=WGRAD, operand=OP_B, **common)
    xa_meta, xs_meta = prep_layouts(key, tuple(x2.shape), x2.dtype, out_dtype)
    xa_tensors = _pack_xa(xa, kind, cfg.backend_name, xa_meta)
    xs_tensors, meta = pack_operand(xs)
    _check_layout(meta, xs_meta, "wgrad's X", key)
    return [*xa_tensors, *xs_tensors]


def _pack_xa(xa, kind: str, backend: str, expected):
    from ..backends.fp8_operands import FoldedOperand

    folded = kind in (PAIR, FOLD)
    if folded and isinstance(xa, FoldedOperand) and not xa.transposed and xa.data.group_rows == 1:
        return xa.data.codes, xa.data.scales
    if not folded and isinstance(xa, QuantizedTensor) and len(xa.tensors()) == _N_XA:
        tensors, meta = pack_operand(xa)
        _check_layout(meta, expected, "fprop's X", backend)
        return tensors
    raise RuntimeError(f"fp4train: the {backend} backend prepared X for fprop as {type(xa).__name__}, not the {kind} "
                       "operand the layer's ops describe")


def _check_layout(got, expected, what: str, key: str) -> None:
    """A prepared operand's metadata must be what backward will rebuild it with (derived from the config)."""
    if got != expected:
        raise RuntimeError(f"fp4train: {what} was prepared as {got}, but the layer's ops describe {expected} ({key})")


@prepare_x.register_fake
def _(x, key, out_dtype):
    xa, xs = _prep_reference(key, x.reshape(-1, x.shape[-1]), out_dtype)
    xa = xa.tensors() if isinstance(xa, QuantizedTensor) else xa
    return [*[torch.empty_like(t) for t in xa], *[torch.empty_like(t) for t in xs.tensors()]]


# X's gradient comes from the layers' backward (dgrad), not through its quantized copies
torch.library.register_autograd("fp4train::prepare_x", lambda ctx, grads: (None, None, None), setup_context=lambda ctx, inputs, output: None)


def _unpack_prep(tensors: list[torch.Tensor], x2: torch.Tensor, config: str, out_dtype: torch.dtype):
    """:func:`prepare_x`'s tensors as ``(fprop's operand, wgrad's X)``."""
    cfg, key = parse(config), _prep_key_of(config)
    xa_meta, xs_meta = prep_layouts(key, tuple(x2.shape), x2.dtype, out_dtype)
    if xa_meta is None:
        from ..backends.fp8_operands import FoldedOperand

        xa = FoldedOperand(FoldedFP8(tensors[0], tensors[1], 1, cfg.backend.operands.counter(x2.device)))
    else:
        xa = unpack_operand(tuple(tensors[:_N_XA]), xa_meta)
    return xa, unpack_operand(tuple(tensors[_N_XA:]), xs_meta)


@functools.lru_cache(maxsize=None)
def _prep_key_of(config: str) -> str | None:
    return prep_key(parse(config))


# ---- the layer's forward and backward ---------------------------------------------------------------------

def reference_layout(x: torch.Tensor, q, axis: int, cdt: torch.dtype):
    """What :func:`~fp4train.linear.operands.prepare` returns for ``x`` (on fake or meta tensors: shapes,
    dtypes and layout), by the reference quantization, without a transform (which keeps the shape)."""
    if not q.quantized:
        return x.to(cdt)
    kw = q.quantize_kwargs()
    block, ax = geometry(x, FORMATS[q.format], axis, kw.get("block"))
    return quantize_tensors(x, None, fmt=q.format, block=block, axis=ax, scale=kw.get("scale", "floor"),
                            four_over_six=kw.get("four_over_six", False))


def _saved_reference(spec: LinearSpec, x2, weight, cdt, save_x: bool, save_w: bool):
    """``(x_saved, w_saved)`` as the reference lays them out (None where nothing is saved or X is the input)."""
    x_saved = w_saved = None
    g, w3 = spec.fprop, spec.wgrad
    source = saved_x_source(spec)
    if save_x and source == X_FPROP:
        x_saved = reference_layout(x2, g.a, 1, cdt)
    elif save_x and source != X_INPUT:
        xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
        x_saved = reference_layout(xm, w3.b, 0, cdt)
    if save_w and saves_fprop_w(spec):
        w_saved = reference_layout(weight, g.b, 1, cdt)
    return x_saved, w_saved


@functools.lru_cache(maxsize=1024)
def saved_layouts(config: str, x2_shape: tuple, x_dtype: torch.dtype, w_shape: tuple, w_dtype: torch.dtype,
                  out_dtype: torch.dtype, save_x: bool, save_w: bool):
    """``(x_meta, n_x, w_meta)``: the metadata that rebuilds the saved X and W from their tensors, and how many
    tensors X has - derived from the layer's config and the call's shapes (on meta tensors)."""
    x2 = torch.empty(x2_shape, dtype=x_dtype, device="meta")
    weight = torch.empty(w_shape, dtype=w_dtype, device="meta")
    x_saved, w_saved = _saved_reference(parse(config).spec, x2, weight, out_dtype, save_x, save_w)
    x_tensors, x_meta = pack_operand(x_saved) if x_saved is not None else ((), None)
    w_meta = pack_operand(w_saved)[1] if w_saved is not None else None
    return x_meta, len(x_tensors), w_meta


def call_plan(config: str, x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, save_x: bool = True,
              save_w: bool = True, x_shared: bool = False) -> OperandPlan:
    """The layer's operand plan for a call on X ``[M, K]`` (memoized: :func:`fp4train.linear.plan.plan_for`)."""
    return plan_for(config, x2.shape[0], x2.shape[1], weight.shape[0], x2.dtype, weight.dtype, out_dtype, x2.is_cuda,
                    kernels_usable_on(x2), save_x, save_w, x_shared)


def _draw_seed(cfg: LayerConfig, x: torch.Tensor) -> int | torch.Tensor:
    """The call's seed: from the device's seed stream (a 0-d int64 tensor there), from torch's CPU generator
    (an int) where the spec draws one, else 0."""
    if cfg.seeded_on_device:
        return device_seed_stream(x.device).next()
    return fresh_seed() if cfg.spec.needs_seed else 0


def _seed_output(cfg: LayerConfig, seed: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The forward op's seed output: a device seed as int64 ``[1]`` there, a host seed as a CPU int64 scalar,
    else a zero int64 scalar on X's device that nothing reads. Not an empty tensor (AOTAutograd's stride
    check of saved tensors fails on zero elements), not an uninitialised one (an op's outputs must be
    deterministic: opcheck)."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(1)
    if cfg.spec.needs_seed:
        return torch.tensor(seed, dtype=torch.int64)
    return x.new_zeros((), dtype=torch.int64)


def _seed_value(cfg: LayerConfig, seed: torch.Tensor) -> int | torch.Tensor:
    """The seed that :func:`_seed_output` encoded (a device seed stays a 0-d tensor, never read on the host)."""
    if seed.shape == (1,):
        return seed.reshape(())
    return int(seed) if cfg.spec.needs_seed else 0


@torch.library.custom_op("fp4train::quantized_linear", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: str,
                     out_dtype: torch.dtype, save_x: bool, save_w: bool, x_prep: list[torch.Tensor]) -> list[torch.Tensor]:
    cfg = parse(config)
    seed = _draw_seed(cfg, x)
    x2 = x.reshape(-1, x.shape[-1])
    prepared = _unpack_prep(x_prep, x2, config, out_dtype) if x_prep else None
    with torch.autocast(x.device.type, enabled=False):
        plan = call_plan(config, x2, weight, out_dtype, save_x, save_w, bool(x_prep))
        if bool(x_prep) != (plan["fprop.a"].how == "shared X"):
            raise RuntimeError(f"fp4train: X came {'prepared' if x_prep else 'unprepared'}, but the layer's plan says "
                               f"fprop's X is {plan['fprop.a']} ({config})")
        y, x_saved, w_saved = forward(x2, weight, bias, cfg.spec, plan, cfg.backend, seed, out_dtype,
                                      save_x=save_x, save_w=save_w, x_prepared=prepared)
    x_meta, _, w_meta = saved_layouts(config, tuple(x2.shape), x.dtype, tuple(weight.shape), weight.dtype, out_dtype, save_x, save_w)
    source = saved_x_source(cfg.spec)
    x_tensors: tuple = ()
    if x_saved is not None and source != X_INPUT:
        x_tensors, meta = pack_operand(x_saved)
        _check_layout(meta, x_meta, "the X saved for wgrad", config)
    w_tensors: tuple = ()
    if w_saved is not None:
        w_tensors, meta = pack_operand(w_saved)
        _check_layout(meta, w_meta, "the W saved for dgrad", config)
    # an X that is the input itself, or that came in prepared, is not an output (an op's output may not
    # alias its input; setup_context saves the input)
    return [y.reshape(*x.shape[:-1], weight.shape[0]), _seed_output(cfg, seed, x), *(() if x_prep else x_tensors), *w_tensors]


@quantized_linear.register_fake
def _(x, weight, bias, config, out_dtype, save_x, save_w, x_prep):
    cfg = parse(config)
    x2 = x.reshape(-1, x.shape[-1])
    x_saved, w_saved = _saved_reference(cfg.spec, x2, weight, out_dtype, save_x, save_w)
    tensors = []
    if x_saved is not None and saved_x_source(cfg.spec) != X_INPUT and not x_prep:
        tensors += pack_operand(x_saved)[0]
    if w_saved is not None:
        tensors += pack_operand(w_saved)[0]
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)
    if cfg.seeded_on_device:
        seed = x.new_empty((1,), dtype=torch.int64)
    else:
        seed = torch.empty((), dtype=torch.int64, device="cpu") if cfg.spec.needs_seed else x.new_empty((), dtype=torch.int64)
    return [y, seed, *[torch.empty_like(t) for t in tensors]]


@torch.library.custom_op("fp4train::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(grad: torch.Tensor, weight: torch.Tensor, x: Optional[torch.Tensor], saved: list[torch.Tensor],
                              seed: torch.Tensor, config: str, x_shape: list[int], x_dtype: torch.dtype, out_dtype: torch.dtype,
                              save_x: bool, save_w: bool, needs_x: bool, needs_w: bool, needs_b: bool) -> list[torch.Tensor]:
    cfg = parse(config)
    m = 1
    for d in x_shape[:-1]:
        m *= d
    if needs_w and not save_x:
        raise RuntimeError("fp4train: dW asked of a quantized_linear called with save_x=False (nothing saved for wgrad)")
    x_meta, n_x, w_meta = saved_layouts(config, (m, x_shape[-1]), x_dtype, tuple(weight.shape), weight.dtype, out_dtype, save_x, save_w)
    if x is not None:
        x_op = x_from_input(x.reshape(-1, x.shape[-1]), cfg.spec, out_dtype)
    else:
        x_op = unpack_operand(tuple(saved[:n_x]), x_meta) if n_x else None
    w_q = unpack_operand(tuple(saved[n_x:]), w_meta) if len(saved) > n_x else None
    dy2 = grad.reshape(-1, weight.shape[0])
    with torch.autocast(dy2.device.type, enabled=False):
        plan = plan_for(config, m, x_shape[-1], weight.shape[0], x_dtype, weight.dtype, out_dtype, weight.is_cuda,
                        kernels_usable_on(weight), save_x, save_w)
        dx, dw, db = backward(dy2, weight, x_op, w_q, cfg.spec, plan, cfg.backend, _seed_value(cfg, seed), out_dtype,
                              x_dtype, (needs_x, needs_w, needs_b))
    out = []
    if needs_x:
        out.append(dx.reshape(x_shape))
    if needs_w:
        out.append(dw)
    if needs_b:
        out.append(db)
    return out


@quantized_linear_backward.register_fake
def _(grad, weight, x, saved, seed, config, x_shape, x_dtype, out_dtype, save_x, save_w, needs_x, needs_w, needs_b):
    out = []
    if needs_x:
        out.append(grad.new_empty(x_shape, dtype=x_dtype))
    if needs_w:
        out.append(torch.empty_like(weight))
    if needs_b:
        out.append(grad.new_empty((weight.shape[0],), dtype=weight.dtype))
    return out


def _setup_context(ctx, inputs, output):
    x, weight, bias, config, out_dtype, save_x, save_w, x_prep = inputs
    _, seed, *saved = output
    x_input = save_x and saved_x_source(parse(config).spec) == X_INPUT
    x_given = list(x_prep[_N_XA:]) if x_prep and save_x else []  # wgrad's packed X, made by prepare_x
    ctx.save_for_backward(weight, seed, x if x_input else None, *x_given, *saved)
    ctx.config, ctx.out_dtype, ctx.save_x, ctx.save_w, ctx.n_prep = config, out_dtype, save_x, save_w, len(x_prep)
    ctx.x_shape, ctx.x_dtype, ctx.has_bias = list(x.shape), x.dtype, bias is not None


def _backward(ctx, grads_out):
    grad_y = grads_out[0]  # the op returns one list: the gradients of its outputs come as one list
    weight, seed, x, *saved = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    grads = iter(torch.ops.fp4train.quantized_linear_backward(
        grad_y, weight, x, saved, seed, ctx.config, ctx.x_shape, ctx.x_dtype, ctx.out_dtype, ctx.save_x, ctx.save_w, *needs))
    dx, dw, db = (next(grads) if n else None for n in needs)
    return dx, dw, db, None, None, None, None, [None] * ctx.n_prep  # x_prep: no gradient


torch.library.register_autograd("fp4train::quantized_linear", _backward, setup_context=_setup_context)
