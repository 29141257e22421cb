"""``QMuon``: Muon for a model's 2D hidden weights and AdamW for the rest, states stored in NVFP4.

Param groups with ``muon=True`` (2D parameters only) take Muon's update, ``torch.optim.Muon``'s arithmetic in its
order:

    B <- mu B + (1 - mu) G          U = G + mu (B - G) (Nesterov) or B
    O = NewtonSchulz(U)             p <- p (1 - lr wd) - lr' O

with ``lr' = adjust(lr, shape)`` (``"match_rms_adamw"`` by default, ``0.2 sqrt(max(rows, cols)) lr``: Muon then
reuses AdamW's learning rate, as the trainer's single ``--lr`` needs). The momentum buffer is stored in NVFP4
(1x16 blocks, :func:`fp4train.optim.state_codec.encode_signed`) where its shape tiles. Newton-Schulz multiplies in
BF16 (``ns_matmul="bf16"``, Muon's own, the default) or on NVFP4 operands (``"nvfp4"``, Full-Stack FP4's native
NVFP4 iteration, with per-step coefficients fitted for it by weight shape,
:func:`~fp4train.optim.ns_coefficients.nvfp4_coefficients`, unless ``ns_coefficients`` says otherwise). The other
groups are :class:`~fp4train.optim.QAdamW`'s.

``quantize_states=False`` with ``ns_matmul="bf16"`` is ``torch.optim.Muon`` plus ``torch.optim.AdamW``, bit for
bit (tested); ``fp4train train --optimizer muon`` runs that, ``--optimizer qmuon`` the quantized states.

A sharded parameter (FSDP2) keeps its momentum sharded (:mod:`fp4train.row_shards`); every process
orthogonalizes the whole update, gathered, and applies its own rows of it.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import row_shards
from ..quantizer import kernels_usable_on
from ..row_shards import local
from . import state_codec
from .newton_schulz import BF16_COEFFICIENTS, as_triples, newton_schulz
from .ns_coefficients import fitted_coefficients, nvfp4_coefficients, shape_coefficients
from .qadamw import QAdamW, _as_tensors, _compile_limit, _put, _stacked, _stacked_keys, _sub

_BUF = "momentum_buffer"
ADJUST_LR = ("original", "match_rms_adamw")
#: Root's clip thresholds of at most this many same-shape parameters are taken by one call (their updates stacked).
#: The compiled parts of an update stay one call per parameter (``multi_tensor`` aside): unrolled over several
#: parameters, they compiled many times longer for little gain on the host.
CHUNK = 8


def _chunks(items: list) -> list[list]:
    return [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]


def robust_part(u: torch.Tensor, quantile: float) -> torch.Tensor:
    """Root's outlier suppression: ``u`` less its soft-thresholded outliers, ``u - sign(u) max(|u| - eps, 0)``, which
    is ``u`` clipped to ``[-eps, eps]``; ``eps`` is the ``quantile`` of ``|u|`` (:func:`clip_thresholds`). The clip
    is exact (no FP32 subtraction)."""
    return _clip(u, clip_thresholds(u[None], quantile)[0])


def _clip(u: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    eps = eps.to(u.dtype)
    return torch.maximum(torch.minimum(u, eps), -eps)


def clip_thresholds(us: torch.Tensor, quantile: float) -> torch.Tensor:
    """Root's clip threshold of each of the stacked updates ``us`` ``[n, ...]``, FP32 ``[n]``: the ``quantile`` of
    ``|u|`` (linear interpolation between order statistics, as ``torch.quantile``) plus 1e-9, all of them at once."""
    a = us.detach().abs().flatten(1).float()
    pos = quantile * (a.shape[1] - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    lo_v, hi_v = _order_statistics(a, lo, hi)
    eps = lo_v if hi == lo else torch.lerp(lo_v, hi_v, pos - lo)
    return eps + 1e-9


@torch.compiler.disable
def _order_statistics(a: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``lo``-th and ``hi``-th smallest entries of each row of ``a`` (from 0; ``hi`` is ``lo`` or ``lo + 1``): by
    selection on the CPU, through the largest entries on a GPU, where ``kthvalue`` runs one thread block over each
    row (about a millisecond per million entries) and ``topk`` a radix sort over all of the device. Left
    out of a compiled update: with ``topk`` inside, Inductor's graph partitioning failed on a GPU."""
    return (_by_selection if a.device.type == "cpu" else _by_largest)(a, lo, hi)


def _by_selection(a: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo_v = a.kthvalue(lo + 1, dim=1).values
    return lo_v, (lo_v if hi == lo else a.kthvalue(hi + 1, dim=1).values)


def _by_largest(a: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = a.topk(a.shape[1] - lo, dim=1, sorted=False).values  # each row's entries from its lo-th smallest up
    two = top.topk(min(2, top.shape[1]), dim=1, largest=False).values  # ascending
    return two[:, 0], two[:, hi - lo]


def adjust_lr(lr: float, how: str, shape: torch.Size) -> float:
    """Muon's learning rate for a ``[rows, cols]`` weight (``torch.optim.Muon``'s two rules)."""
    a, b = shape[:2]
    return lr * (math.sqrt(max(1, a / b)) if how == "original" else 0.2 * math.sqrt(max(a, b)))


class QMuon(QAdamW):
    """Muon on the groups marked ``muon=True``, AdamW on the others (see the module docstring).

    >>> hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    >>> rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    >>> opt = QMuon([{"params": hidden, "muon": True}, {"params": rest}], lr=3e-3)
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, *, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_matmul: str = "bf16", ns_coefficients: tuple[float, float, float] | None = None,
                 adjust_lr_fn: str = "match_rms_adamw", quantize_states: bool = True, compiled: bool = False,
                 stochastic_states: bool = True, seed: int = 0, robust_quantile: float | None = None,
                 multi_tensor: bool = False):
        if ns_matmul not in ("bf16", "nvfp4"):
            raise ValueError(f"QMuon: ns_matmul must be bf16 or nvfp4, got {ns_matmul!r}")
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"QMuon: adjust_lr_fn must be one of {ADJUST_LR}, got {adjust_lr_fn!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"QMuon: momentum must be in [0, 1), got {momentum}")
        if robust_quantile is not None and not 0.0 < robust_quantile <= 1.0:
            raise ValueError(f"QMuon: robust_quantile must be in (0, 1] or None, got {robust_quantile}")
        if isinstance(ns_coefficients, str) and ns_coefficients not in ("shape", "fitted", "nvfp4"):
            raise ValueError(f"QMuon: ns_coefficients must be (a, b, c), per-step triples, 'shape', 'fitted', 'nvfp4' or "
                             f"None, got {ns_coefficients!r}")
        if ns_coefficients == "nvfp4" and ns_matmul != "nvfp4":
            raise ValueError("QMuon: ns_coefficients='nvfp4' are fitted for NVFP4 products: use them with ns_matmul='nvfp4'")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, quantize_states=quantize_states,
                         compiled=compiled, stochastic_states=stochastic_states, seed=seed, multi_tensor=multi_tensor)
        coefficients = ns_coefficients or ("nvfp4" if ns_matmul == "nvfp4" else BF16_COEFFICIENTS)
        coefficients = coefficients if isinstance(coefficients, str) else as_triples(coefficients)
        for group in self.param_groups:
            group.setdefault("muon", False)
            for k, v in dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_matmul=ns_matmul,
                             ns_coefficients=coefficients, adjust_lr_fn=adjust_lr_fn, robust_quantile=robust_quantile).items():
                group.setdefault(k, v)
            if group["muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(f"QMuon: Muon groups take 2D weights only, got shapes {bad}; put the others in a "
                                     "group without muon=True (AdamW)")

    def _group_step(self, group: dict) -> None:
        if group["muon"]:
            self._muon_group(group)
        else:
            self._adamw_group(group)

    def _muon_group(self, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        batched: dict[tuple, list] = {}  # compiled: the parameters of one shape and dtype, updated together
        for p in group["params"]:
            if p.grad is None:
                continue
            pl, g = local(p), local(p.grad)  # a sharded parameter: this process's rows
            state = self.state[p]
            quantized = group["quantize_states"] and state_codec.fits(p.shape)
            step = int(state.get("step", 0)) + 1
            stored = _sub(state, _BUF) if quantized and _BUF + ".codes" in state else None
            keys = self.state_keys(p, step, 0) if quantized else None
            if stored is not None and self.compiled and not row_shards.is_sharded(p):  # the first step runs eagerly
                batched.setdefault((p.shape, p.dtype, p.device), []).append((p, step, g, stored, keys))
                continue
            settings = _muon_settings(group, p.shape)
            scalars = dict(decay=1 - lr * wd, step_lr=adjust_lr(lr, group["adjust_lr_fn"], p.shape))
            if not quantized:
                buf = local(state[_BUF]) if _BUF in state else torch.zeros_like(g, memory_format=torch.preserve_format)
                _muon_update(pl, g, buf, p=p, **settings, **scalars)
                state[_BUF] = row_shards.like(buf, p)
                continue
            self._store_momentum(p, step, _quantized_muon_update(pl, g, stored, keys=keys, p=p, **settings, **scalars))
        with _compile_limit(self.compiled):
            for (shape, _, device), items in batched.items():
                settings = _muon_settings(group, shape)
                scalars = _as_tensors(dict(decay=1 - lr * wd, step_lr=adjust_lr(lr, group["adjust_lr_fn"], shape)), device)
                for chunk in (_chunks(items) if not self.multi_tensor else [items]):
                    keys = [k for *_, k in chunk]
                    keys = _stacked_keys(keys, device) if keys[0] is not None else None
                    # the NVFP4 iteration's quantizer writes in place, which torch.vmap cannot map: one call a parameter
                    batched = self.multi_tensor and settings["ns_matmul"] == "bf16"
                    update = _batched_muon_updates if batched else _quantized_muon_updates
                    for (p, step, *_), stored in zip(chunk, update(
                            [p for p, *_ in chunk], [g for _, _, g, *_ in chunk], [st for *_, st, _ in chunk], keys,
                            **settings, **scalars)):
                        self._store_momentum(p, step, stored)

    def _store_momentum(self, p: torch.Tensor, step: int, stored: dict) -> None:
        state = self.state[p]
        state.clear()
        _put(state, _BUF, {k: row_shards.by_rows(x, p) for k, x in stored.items()})
        state["step"] = torch.tensor(float(step))  # the count the stochastic-rounding keys derive from


def _muon_settings(group: dict, shape: torch.Size) -> dict:
    """The per-shape constants of a Muon group's update (the coefficients picked for the shape where Root's are)."""
    coefficients = group["ns_coefficients"]
    if isinstance(coefficients, str):  # chosen for this weight's shape
        pick = {"shape": shape_coefficients, "fitted": fitted_coefficients, "nvfp4": nvfp4_coefficients}[coefficients]
        coefficients = pick(shape[0], shape[1], group["ns_steps"])
    return dict(mu=group["momentum"], nesterov=group["nesterov"], robust_quantile=group["robust_quantile"],
                coefficients=as_triples(coefficients), ns_steps=group["ns_steps"], ns_matmul=group["ns_matmul"])



def _muon_update(pl, g, buf, *, p=None, mu, nesterov, robust_quantile, coefficients, ns_steps, ns_matmul, decay, step_lr):
    """One Muon (Root with ``robust_quantile``) step of ``pl`` from the FP32 momentum ``buf`` (updated in place).
    ``p``: the whole parameter when ``pl`` is this process's rows of a sharded one (None: ``pl`` is whole)."""
    update = _momentum(g, buf, mu=mu, nesterov=nesterov)
    if p is not None:
        update = row_shards.whole(update, p)
    eps = None if robust_quantile is None else clip_thresholds(update[None], robust_quantile)[0]
    _orthogonalized_step(pl, update, eps, p=p, coefficients=coefficients, ns_steps=ns_steps, ns_matmul=ns_matmul,
                         decay=decay, step_lr=step_lr)


def _momentum(g, buf, *, mu, nesterov):
    """Muon's momentum ``buf`` updated in place by ``g``; returns the update direction (Nesterov's or ``buf``)."""
    buf.copy_(torch.lerp(buf, g, 1 - mu))  # lerp_'s arithmetic; the out-of-place ops are the ones torch.vmap batches
    return g.lerp(buf, mu) if nesterov else buf


def _orthogonalized_step(pl, update, eps, *, p=None, coefficients, ns_steps, ns_matmul, decay, step_lr):
    """``pl`` decayed and moved by the orthogonalized ``update``, clipped to ``[-eps, eps]`` first (Root) unless
    ``eps`` is None."""
    if eps is not None:  # Root: the outliers soft-thresholded away before orthogonalizing
        update = _clip(update, eps)
    update = newton_schulz(update, coefficients, ns_steps, matmul=ns_matmul)
    pl.mul_(decay)
    if p is not None:
        update = row_shards.own_rows(update, p)
    if isinstance(step_lr, torch.Tensor):  # compiled: a tensor, which add's alpha cannot be
        pl.sub_(update * step_lr)
    else:
        pl.add_(update, alpha=-step_lr)


def _quantized_muon_update(pl, g, stored: dict | None, *, keys, p=None, **kwargs) -> dict:
    """:func:`_muon_update` from the NVFP4-stored momentum (``None``: zero, the first step); returns it stored again."""
    buf = (state_codec.decode_signed(stored, pl.shape) if stored is not None
           else torch.zeros_like(g, dtype=torch.float32))
    _muon_update(pl, g, buf, p=p, **kwargs)
    whole = p is None
    return state_codec.encode_signed(buf, amax_over=None if whole else row_shards.amax_over(p), keys=keys,
                                     offset=0 if whole else row_shards.element_offset(p))


def _quantized_muon_updates(ps, gs, stored: list[dict], keys: torch.Tensor | None, *, mu, nesterov, robust_quantile,
                            **step) -> list[dict]:
    """:func:`_quantized_muon_update` of each of the same-shape whole parameters ``ps`` (``keys``: their
    stochastic-rounding keys ``[n, 2]`` or None): the momenta, then Root's clip thresholds of all of them at once (a
    library call the compiler leaves out), then the steps; compiled one parameter a call. Returns the momenta stored
    again."""
    keys = [None] * len(ps) if keys is None else keys.unbind()
    momenta = [_compiled(_momentum_from_stored)(g, st, k, mu=mu, nesterov=nesterov) for g, st, k in zip(gs, stored, keys)]
    eps = None if robust_quantile is None else clip_thresholds(torch.stack([u for u, _ in momenta]), robust_quantile)
    if step["ns_matmul"] == "nvfp4" and len(ps) > 1 and kernels_usable_on(ps[0]) and ps[0].is_cuda:
        # one NVFP4 iteration for the stack, its products quantized by the kernels: a launch a pass for all of it. (On a
        # CPU the reference quantizes a stack one matrix at a time anyway: per parameter there, a smaller compile.)
        _compiled(_stacked_orthogonalized_steps)(ps, torch.stack([u for u, _ in momenta]), eps, **step)
    else:
        for i, (p, (u, _)) in enumerate(zip(ps, momenta)):
            _compiled(_orthogonalized_step)(p, u, None if eps is None else eps[i], **step)
    return [st for _, st in momenta]


def _stacked_orthogonalized_steps(ps, updates, eps, *, coefficients, ns_steps, ns_matmul, decay, step_lr):
    """:func:`_orthogonalized_step` of each of the same-shape whole parameters ``ps`` by its update in the stack
    ``updates`` (``eps``: their clip thresholds ``[n]``, or None), the NVFP4 Newton-Schulz iteration run once for the
    stack (each matrix its own tensor scales: the same iteration as one at a time, its sums in another order)."""
    if eps is not None:
        updates = _clip(updates, eps[:, None, None])
    for p, update in zip(ps, newton_schulz(updates, coefficients, ns_steps, matmul=ns_matmul).unbind()):
        p.mul_(decay)
        if isinstance(step_lr, torch.Tensor):  # compiled: a tensor, which add's alpha cannot be
            p.sub_(update * step_lr)
        else:
            p.add_(update, alpha=-step_lr)


def _batched_muon_updates(ps, gs, stored: list[dict], keys: torch.Tensor | None, *, mu, nesterov, robust_quantile,
                          **step) -> list[dict]:
    """:func:`_quantized_muon_updates` in two compiled calls for all of ``ps``: the momenta and the steps, each the
    one-parameter function mapped over the stacked tensors (``torch.vmap``), Root's clip thresholds between them."""
    updates, st = _compiled(_batched_momenta)(torch.stack(gs), _stacked(stored), keys, mu=mu, nesterov=nesterov)
    eps = None if robust_quantile is None else clip_thresholds(updates, robust_quantile)
    torch._foreach_copy_(ps, list(_compiled(_batched_steps)(torch.stack(ps), updates, eps, **step).unbind(0)))
    return [{k: x[i] for k, x in st.items()} for i in range(len(ps))]


def _batched_momenta(gs, stored: dict, keys, *, mu, nesterov):
    return torch.vmap(lambda g, s, k: _momentum_from_stored(g, s, k, mu=mu, nesterov=nesterov),
                      in_dims=(0, 0, None if keys is None else 0))(gs, stored, keys)


def _batched_steps(ps, updates, eps, **step):
    def one(p, u, e, step):
        p = p.clone()
        _orthogonalized_step(p, u, e, **step)
        return p

    return torch.vmap(one, in_dims=(0, 0, None if eps is None else 0, None))(ps, updates, eps, step)


def _momentum_from_stored(g, stored: dict, keys, *, mu, nesterov) -> tuple[torch.Tensor, dict]:
    """The update direction of the NVFP4-stored momentum after ``g``, and the momentum stored again."""
    buf = state_codec.decode_signed(stored, g.shape)
    update = _momentum(g, buf, mu=mu, nesterov=nesterov)
    return update, state_codec.encode_signed(buf, keys=keys)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def muon_groups(model: torch.nn.Module, weight_decay: float, *, exclude=()) -> list[dict]:
    """QMuon's param groups for a transformer: Muon on the 2D hidden weights (every 2D parameter but embeddings and
    the output head, as Muon's authors train), AdamW with decay on the embeddings and head, AdamW without decay on
    the rest (norm weights, biases). ``exclude``: parameters grouped elsewhere (LoRA-SVD factors)."""
    muon, adamw, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or any(p is e for e in exclude):
            continue
        if p.ndim == 2 and "embed" not in name and "lm_head" not in name:
            muon.append(p)
        elif p.ndim >= 2:
            adamw.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": muon, "muon": True, "weight_decay": weight_decay},
              {"params": adamw, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class QRoot(QMuon):
    """Root (arXiv 2511.20626) on the groups marked ``muon=True``, AdamW on the others, states in NVFP4 (Full-Stack
    FP4's Q-Root): QMuon's momentum and update, with the update's outliers soft-thresholded away before
    orthogonalizing (:func:`robust_part`, the 0.9 quantile of ``|U|`` as Root's release takes it) and Newton-Schulz
    coefficients by weight shape. With quantized states (Q-Root, the default) the iteration is Full-Stack FP4's native
    NVFP4 Newton-Schulz (``ns_matmul="nvfp4"``, its per-step coefficients fitted for NVFP4 products by shape,
    :func:`~fp4train.optim.ns_coefficients.nvfp4_coefficients`); ``ns_matmul="bf16"`` with quantized states is ours
    (``--optimizer qroot_bf16ns``). ``quantize_states=False`` is Root in BF16 (``fp4train train --optimizer root``),
    the paper's baseline: BF16 products with Root's coefficients (``ns_coefficients="shape"``: the released ones where
    the shape has them, else Muon's, :func:`~fp4train.optim.ns_coefficients.shape_coefficients`; ``"fitted"``: fitted
    to any shape's random-matrix spectrum, :func:`~fp4train.optim.ns_coefficients.fitted_coefficients`, which lands
    low-rank updates farther)."""

    def __init__(self, params, lr: float = 1e-3, *, robust_quantile: float | None = 0.9, ns_coefficients=None,
                 ns_matmul: str | None = None, **kwargs):
        if ns_matmul is None:
            ns_matmul = "nvfp4" if kwargs.get("quantize_states", True) else "bf16"
        if ns_coefficients is None:
            ns_coefficients = "nvfp4" if ns_matmul == "nvfp4" else "shape"
        super().__init__(params, lr=lr, robust_quantile=robust_quantile, ns_coefficients=ns_coefficients, ns_matmul=ns_matmul,
                         **kwargs)
