"""The quantized linear as ``torch.library`` ops, so that ``torch.compile`` keeps it in the model's graph.

Eager calls go through :class:`~fp4train.linear.function.QuantizedLinearFunction`. Under
``torch.compile`` a quantized linear is instead opaque nodes of the model's graph:

* ``fp4train::quantized_linear(x, weight, bias, config, out_dtype, save_x, save_w, x_prep)`` ->
  ``[Y, seed, *saved]``: :func:`~fp4train.linear.function.forward` run as it is (fp4train's
  kernels, the backend's GEMMs). ``seed`` is the call's stochastic-rounding / random-sign seed,
  drawn inside the op from torch's default CPU generator exactly where an eager call draws it
  (a CPU int64 scalar). Two cases keep CPU tensors out of the graph, so that
  ``torch.compile(mode="reduce-overhead")`` can capture it in CUDA graphs (a CPU seed makes Inductor skip
  them for that graph; a seed drawn at capture would be replayed, the same every step): a spec that draws
  no seed (:attr:`LinearSpec.needs_seed` false) outputs a zero int64 scalar on X's device (never read), and
  with :func:`~fp4train.linear.module.set_device_seeds` a seeded spec draws its seed from the device's
  :class:`~fp4train.counter_rng.DeviceSeedStream` and outputs it as an int64 ``[1]`` tensor there (the
  backward op derives its operands' keys from it on the device). ``saved`` are the tensors of the X and W
  that backward needs, packed (FP4 codes + scales), as outputs, so the compiler's partitioner sees and
  frees them.
* ``fp4train::quantized_linear_backward(dY, weight, x, saved, seed, ...)`` -> ``[dX, dW, db]``
  (those asked for): :func:`~fp4train.linear.function.backward`.
* ``fp4train::prepare_x(x, key, out_dtype)`` -> X prepared for fprop and for wgrad (``x_prep``),
  where the layer's specs make that deterministic (:func:`prep_kind`). The eager path shares one
  preparation among the layers that read the same input through a memo keyed on tensor identity
  (:mod:`~fp4train.linear.shared_input`), which is unsafe in a graph (the compiler reuses buffers
  without bumping version counters). As an op of its own, the compiler's common-subexpression pass
  merges the q/k/v (and gate/up) calls into one instead.

The compiler then sees one graph for the whole model: no graph break per layer (guards and
Python between graphs), and the layers' neighbours (norms, activations, residual adds) fuse
and free their activations as in a BF16 model. The ops' numerics are the eager ones, bit for bit.

Everything that is not a tensor - the spec and backend - travels as a string, their JSON
(:func:`config_key`): not a process-local index, since Inductor caches compiled graphs on disk
with the ops' arguments in them and another process must read the same recipe from them. The
fake (shape) implementations describe the saved operands by the reference quantization's layouts
on fake tensors: the kernels write the same layouts (``torch.library.opcheck`` in the tests).
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from .. import backends
from ..counter_rng import device_seed_stream, fresh_seed
from ..formats.fold import FoldedFP8, empty_folded
from ..formats.qtensor import QuantizedTensor
from ..formats.quantize import FORMATS, encode_blocks, geometry, quantize_tensors
from ..recipes.spec import GemmSpec, LinearSpec, _linear_from_dict, _to_plain
from .function import X_FPROP, X_INPUT, X_WGRAD, backward, deterministic, forward, saved_x_source, saves_fprop_w, x_from_input
from .operands import FPROP, OP_A, OP_B, WGRAD, pack_operand, pad_rows, prepare, prepare_now, unpack_operand
from .shared_input import UNSHARED

#: (spec, backend) by the key the ops take: the key is the spec itself in JSON, not a process-local
#: index, because compiled graphs are cached on disk across processes with their arguments baked in
_CONFIGS: dict[str, tuple[LinearSpec, str]] = {}

#: what the real forward saved besides tensors (QuantizedTensor metadata), by its call's shapes
_SKELETONS: dict[tuple, tuple] = {}


def config_key(spec: LinearSpec, backend: str) -> str:
    """The string that names ``(spec, backend)`` to the ops: the spec's JSON (stable across processes)."""
    key = json.dumps({"backend": backend, "linear": _to_plain(spec)}, sort_keys=True, separators=(",", ":"))
    _CONFIGS.setdefault(key, (spec, backend))
    return key


def _parse(key: str) -> tuple[LinearSpec, str]:
    if key not in _CONFIGS:  # a compiled graph from another process's cache
        d = json.loads(key)
        _CONFIGS[key] = (_linear_from_dict(d["linear"]), d["backend"])
    return _CONFIGS[key]


#: what prepare_x made besides tensors (the operands' metadata), by its call's key and shapes
_PREP_SKELETONS: dict[tuple, tuple] = {}

#: the kinds of shared X preparation: the backend's one-pass MXFP4 pair (fprop's X folded into FP8 +
#: wgrad's X packed, one read), FP8 rowwise X for both GEMMs, and MXFP4 with a block Hadamard on either
#: GEMM (fprop's X folded, the transform fused into the fold; wgrad's X transformed and packed -
#: hadamard_mxfp4, and AdaHOP's layers with an IHT). The two pair kinds are the backend's ``pair_kind`` names.
PAIR, FP8_ROWWISE, FOLD = "mxfp4", "fp8", "fold"
#: every kind's fprop operand is two tensors (FP8 codes + group scales, or E4M3 codes + row scales)
_N_XA = 2


def prep_kind(spec: LinearSpec, backend: str) -> str | None:
    """Which shared X preparation this layer's specs allow, or None (X is then prepared inside the
    layer's own op). Shared preparations are deterministic (nearest rounding, no random signs), have
    wgrad's X saved packed, and are made by a backend that prepares its own operands - which of them,
    its predicates say (``pair_kind``, ``fuses``; backends/fp8_blockwise.py)."""
    g, w3 = spec.fprop, spec.wgrad
    be = backends.get(backend)
    if getattr(be, "pair_kind", None) is None or saved_x_source(spec) != X_WGRAD or g.outliers is not None or w3.outliers is not None:
        return None
    if not (g.a.quantized and w3.b.quantized and deterministic(g.a, g.transform) and deterministic(w3.b, w3.transform)):
        return None
    pair = be.pair_kind(g.a, w3.b) if g.transform is None and w3.transform is None else None
    if pair is not None:
        return pair
    if be.folds_1x32(g.a) and be.folds_1x32(w3.b) and (g.transform is None or be.fuses(g.a, g.transform)):
        return FOLD
    return None


def prep_key(spec: LinearSpec, backend: str) -> str | None:
    """The key of this layer's shared X preparation: its fprop and wgrad X specs and transforms and the
    backend (so layers with other W or dY specs share it too); None where :func:`prep_kind` is None."""
    if prep_kind(spec, backend) is None:
        return None
    g, w3 = spec.fprop, spec.wgrad
    return config_key(LinearSpec(fprop=GemmSpec(a=g.a, transform=g.transform), wgrad=GemmSpec(b=w3.b, transform=w3.transform)), backend)


@functools.lru_cache(maxsize=None)
def _prep_kind_of(key: str) -> str | None:
    """:func:`prep_kind` of a preparation key, once per key (the ops run it on every call)."""
    return prep_kind(*_parse(key))


def prep_fits(x: torch.Tensor, key: str) -> bool:
    """Does X's shape, dtype and device allow the shared preparation ``key`` names? The backend's
    predicates decide (``pair_fits``, ``fold_fits``)."""
    spec, name = _parse(key)
    kind, be = prep_kind(spec, name), backends.get(name)  # traced by dynamo (once per compilation): no cache wrapper
    if kind == FOLD:
        return be.fold_fits(x, -1, spec.fprop.transform)
    return be.pair_fits(kind, x)


@torch.library.custom_op("fp4train::prepare_x", mutates_args=())
def prepare_x(x: torch.Tensor, key: str, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """X ``[..., K]`` prepared for fprop (along K, as the backend multiplies it) and for wgrad (along M,
    packed, as the layer saves it), by the kind :func:`prep_kind` names. Deterministic, so the compiler's
    common-subexpression pass merges the calls of layers that read the same X (q/k/v, gate/up) into one -
    what the eager memo (:mod:`~fp4train.linear.shared_input`) does outside a graph."""
    spec, name = _parse(key)
    backend, kind = backends.get(name), _prep_kind_of(key)
    g, w3 = spec.fprop, spec.wgrad
    x2 = x.reshape(-1, x.shape[-1])
    both = backend.operand_pair(x2, g.a, w3.b, seeds=(None, None)) if kind in (PAIR, FP8_ROWWISE) else None
    if kind == PAIR and both is None:
        raise RuntimeError(f"fp4train: the {name} backend made no operand pair for X {tuple(x2.shape)} ({x2.dtype}, {x2.device})")
    if both is not None:
        xa, xs = both
    else:  # as fprop() and forward() prepare them, seeds unused (deterministic)
        xa = prepare_now(x2, g.a, axis=1, transform=g.transform, seed=0, gemm=FPROP, operand=OP_A, compute_dtype=out_dtype,
                         backend=backend)
        xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
        xs = prepare(xm, w3.b, axis=0, transform=w3.transform, seed=0, gemm=WGRAD, operand=OP_B, compute_dtype=out_dtype)
    xa_tensors, xa_meta = _pack_xa(xa, kind, name)
    xs_tensors, xs_meta = pack_operand(xs)
    _PREP_SKELETONS[(key, tuple(x2.shape), x2.dtype, out_dtype)] = (xa_meta, xs_meta)
    return [*xa_tensors, *xs_tensors]


def _pack_xa(xa, kind: str, backend: str):
    from ..backends.fp8_blockwise import FoldedOperand

    folded = kind in (PAIR, FOLD)
    if folded and isinstance(xa, FoldedOperand) and not xa.transposed and xa.data.group_rows == 1:
        return (xa.data.codes, xa.data.scales), None
    if not folded and isinstance(xa, QuantizedTensor) and len(xa.tensors()) == _N_XA:
        return pack_operand(xa)
    raise RuntimeError(f"fp4train: the {backend} backend prepared X for fprop as {type(xa).__name__}, not the {kind} "
                       "operand the compiled graph was traced with")


@prepare_x.register_fake
def _(x, key, out_dtype):
    spec, _ = _parse(key)
    kind, g, w3 = _prep_kind_of(key), spec.fprop, spec.wgrad
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if kind == FP8_ROWWISE:
        xa = list(_reference_layout(x2, g.a, 1, out_dtype).tensors())
    else:  # folded into FP8 with 1x128 group scales
        xa = list(empty_folded(m, k, 1, like=x2))
    xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
    xs = _reference_layout(xm, w3.b, 0, out_dtype)
    return [*[torch.empty_like(t) for t in xa], *[torch.empty_like(t) for t in xs.tensors()]]


# X's gradient comes from the layers' backward (dgrad), not through its quantized copies
torch.library.register_autograd("fp4train::prepare_x", lambda ctx, grads: (None, None, None), setup_context=lambda ctx, inputs, output: None)


@functools.lru_cache(maxsize=None)
def _prep_key_of(config: str) -> str | None:
    """:func:`prep_key` of a layer's config (once per config: the JSON is not rebuilt on every call)."""
    return prep_key(*_parse(config))


def _unpack_prep(tensors: list[torch.Tensor], x2: torch.Tensor, config: str, out_dtype: torch.dtype):
    """:func:`prepare_x`'s tensors as ``(fprop's operand, wgrad's X)``."""
    name = _parse(config)[1]
    key = _prep_key_of(config)
    xa_meta, xs_meta = _PREP_SKELETONS[(key, tuple(x2.shape), x2.dtype, out_dtype)]
    if xa_meta is None:
        from ..backends.fp8_blockwise import FoldedOperand

        xa = FoldedOperand(FoldedFP8(tensors[0], tensors[1], 1, backends.get(name)._counter(x2.device)))
    else:
        xa = unpack_operand(tuple(tensors[:_N_XA]), xa_meta)
    return xa, unpack_operand(tuple(tensors[_N_XA:]), xs_meta)


def _config(config: str):
    spec, name = _parse(config)
    return spec, backends.get(name)


def _skeleton_key(config, x2_shape, x_dtype, w_shape, out_dtype, save_x, save_w) -> tuple:
    return (config, tuple(x2_shape), x_dtype, tuple(w_shape), out_dtype, save_x, save_w)


def _saved_tensors(x_saved, w_saved, x_source: str | None, x_given: bool = False):
    """``(tensors, x_meta, n_x, w_meta)``: the tensors the forward op outputs for backward and what
    rebuilds the operands from them. An X that is the input itself, or that came in prepared
    (``x_given``: its ``n_x`` tensors are prepare_x's), is not among the outputs (an op's output may not
    alias its input; setup_context saves the input)."""
    x_tensors, x_meta = pack_operand(x_saved) if x_saved is not None and x_source != X_INPUT else ((), None)
    w_tensors, w_meta = pack_operand(w_saved) if w_saved is not None else ((), None)
    return [*(() if x_given else x_tensors), *w_tensors], x_meta, len(x_tensors), w_meta


@torch.library.custom_op("fp4train::quantized_linear", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: str,
                     out_dtype: torch.dtype, save_x: bool, save_w: bool, x_prep: list[torch.Tensor]) -> list[torch.Tensor]:
    spec, backend = _config(config)
    seed = _draw_seed(config, spec, x)
    x2 = x.reshape(-1, x.shape[-1])
    prepared = _unpack_prep(x_prep, x2, config, out_dtype) if x_prep else None
    with torch.autocast(x.device.type, enabled=False):
        y, x_saved, w_saved = forward(x2, weight, bias, spec, backend, seed, out_dtype, save_x=save_x, save_w=save_w,
                                      shared=UNSHARED, x_prepared=prepared)
    tensors, x_meta, n_x, w_meta = _saved_tensors(x_saved, w_saved, saved_x_source(spec), x_given=bool(x_prep))
    _SKELETONS[_skeleton_key(config, x2.shape, x.dtype, weight.shape, out_dtype, save_x, save_w)] = (x_meta, n_x, w_meta)
    return [y.reshape(*x.shape[:-1], weight.shape[0]), _seed_output(spec, seed, x), *tensors]


@functools.lru_cache(maxsize=None)
def with_device_seeds(config: str) -> str:
    """``config`` asking its calls to draw their seeds on the device (what the ops take under
    :func:`~fp4train.linear.module.set_device_seeds`): part of the ops' arguments, so that a compiled graph's
    cache key and the fake implementation's seed layout follow it."""
    d = json.loads(config)
    d["device_seeds"] = True
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=None)
def _device_seeded(config: str) -> bool:
    """Do the calls of ``config`` draw their seeds on the device (:func:`with_device_seeds`, and the spec draws
    one)? Stochastic-rounding keys and random Hadamard signs both derive from a device seed (``operands``)."""
    return bool(json.loads(config).get("device_seeds")) and _parse(config)[0].needs_seed


def _draw_seed(config: str, spec: LinearSpec, x: torch.Tensor) -> int | torch.Tensor:
    """The call's seed: from the device's seed stream (a 0-d int64 tensor there), from torch's CPU generator
    (an int) where the spec draws one, else 0."""
    if _device_seeded(config):
        return device_seed_stream(x.device).next()
    return fresh_seed() if spec.needs_seed else 0


def _seed_output(spec: LinearSpec, seed: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The forward op's seed output: the seed as a CPU int64 scalar where the spec draws one, else a zero
    int64 scalar on X's device that nothing reads (no CPU tensor in the graph; see the module docstring).
    Not an empty tensor (AOTAutograd's stride check of saved tensors fails on zero elements), not an
    uninitialised one (an op's outputs must be deterministic: opcheck). The backward op reads the seed back
    with :func:`_seed_value`."""
    if isinstance(seed, torch.Tensor):  # a device seed: shape (1,), which tells it from a host seed's scalar
        return seed.reshape(1)
    if spec.needs_seed:
        return torch.tensor(seed, dtype=torch.int64)
    return x.new_zeros((), dtype=torch.int64)


def _seed_value(spec: LinearSpec, seed: torch.Tensor) -> int | torch.Tensor:
    """The seed that :func:`_seed_output` encoded: a device seed as the 0-d tensor it was (never read on the
    host), a host seed as its int, 0 where the spec draws none (its tensor is not read)."""
    if seed.shape == (1,):
        return seed.reshape(())
    return int(seed) if spec.needs_seed else 0


@quantized_linear.register_fake
def _(x, weight, bias, config, out_dtype, save_x, save_w, x_prep):
    spec, _ = _config(config)
    x2 = x.reshape(-1, x.shape[-1])
    cdt = out_dtype
    x_saved = w_saved = None
    g, w3 = spec.fprop, spec.wgrad
    # the saved operands' layouts as the reference quantization makes them (the kernels write the
    # same; a transform keeps the shape and so is left out)
    source = saved_x_source(spec)
    if save_x and source == X_FPROP:
        x_saved = _reference_layout(x2, g.a, 1, cdt)
    elif save_x and source != X_INPUT:
        xm = pad_rows(x2, w3.transform.block) if w3.transform is not None else x2
        x_saved = _reference_layout(xm, w3.b, 0, cdt)
    if save_w and saves_fprop_w(spec):
        w_saved = _reference_layout(weight, g.b, 1, cdt)
    tensors, *_ = _saved_tensors(x_saved, w_saved, source, x_given=bool(x_prep))
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)
    if _device_seeded(config):
        seed = x.new_empty((1,), dtype=torch.int64)
    else:
        seed = torch.empty((), dtype=torch.int64, device="cpu") if spec.needs_seed else x.new_empty((), dtype=torch.int64)
    return [y, seed, *[torch.empty_like(t) for t in tensors]]


def _reference_layout(x: torch.Tensor, q, axis: int, cdt: torch.dtype):
    """What :func:`~fp4train.linear.operands.prepare` returns for ``x`` (fake tensors: shapes and
    dtypes), by the reference quantization, without a transform."""
    if not q.quantized:
        return x.to(cdt)
    kw = q.quantize_kwargs()
    block, ax = geometry(x, FORMATS[q.format], axis, kw.get("block"))
    return quantize_tensors(x, None, fmt=q.format, block=block, axis=ax, scale=kw.get("scale", "floor"),
                            four_over_six=kw.get("four_over_six", False), encode=encode_blocks)


@torch.library.custom_op("fp4train::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(grad: torch.Tensor, weight: torch.Tensor, x: Optional[torch.Tensor], saved: list[torch.Tensor],
                              seed: torch.Tensor, config: str, x_shape: list[int], x_dtype: torch.dtype, out_dtype: torch.dtype,
                              save_x: bool, save_w: bool, needs_x: bool, needs_w: bool, needs_b: bool) -> list[torch.Tensor]:
    spec, backend = _config(config)
    m = 1
    for d in x_shape[:-1]:
        m *= d
    key = _skeleton_key(config, (m, x_shape[-1]), x_dtype, weight.shape, out_dtype, save_x, save_w)
    if key not in _SKELETONS:
        raise RuntimeError(f"fp4train: quantized_linear_backward found no forward for {key} in this process")
    x_meta, n_x, w_meta = _SKELETONS[key]
    if needs_w and not save_x:
        raise RuntimeError("fp4train: dW asked of a quantized_linear called with save_x=False (nothing saved for wgrad)")
    if x is not None:
        x_op = x_from_input(x.reshape(-1, x.shape[-1]), spec, out_dtype)
    else:
        x_op = unpack_operand(tuple(saved[:n_x]), x_meta) if n_x else None
    w_q = unpack_operand(tuple(saved[n_x:]), w_meta) if len(saved) > n_x else None
    dy2 = grad.reshape(-1, weight.shape[0])
    with torch.autocast(dy2.device.type, enabled=False):
        dx, dw, db = backward(dy2, weight, x_op, w_q, spec, backend, _seed_value(spec, seed), out_dtype, x_dtype, (needs_x, needs_w, needs_b))
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
    spec, _ = _parse(config)
    x_input = save_x and saved_x_source(spec) == X_INPUT
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


def quantized_linear_in_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: str,
                              prep: str | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The quantized linear as the graph op (what :class:`QuantizedLinear` runs under ``torch.compile``)."""
    grad = torch.is_grad_enabled()
    save_x = grad and weight.requires_grad
    save_w = grad and x.requires_grad
    x_prep = torch.ops.fp4train.prepare_x(x, prep, out_dtype) if save_x and prep is not None and prep_fits(x, prep) else []
    return torch.ops.fp4train.quantized_linear(x, weight, bias, config, out_dtype, save_x, save_w, x_prep)[0]
