"""``QAdamW``: AdamW with both moments stored in NVFP4 (Full-Stack FP4's Q-AdamW, docs/methods.md).

The update is AdamW's (decoupled weight decay, bias correction), computed in FP32 from the decoded states:

    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
    p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

after which ``m`` and ``v`` are stored again: ``m`` as NVFP4, ``v`` through the second-moment transform of
:mod:`fp4train.optim.state_codec` (sqrt, tile mean subtracted, block Hadamard, NVFP4), with stochastic rounding by
default (``stochastic_states``): with round-to-nearest a stored moment stops following its gradients (an entry
whose block scale another entry holds does not decay; :mod:`~fp4train.optim.state_codec`). Each parameter and step
draws from its own keys, derived from ``seed``, the parameter's position and its step count, so a resumed run
draws what the uninterrupted one did. A parameter whose shape
the codec cannot tile (biases, norm weights, odd shapes) keeps FP32 moments, as ``torch.optim.AdamW`` does;
:meth:`QAdamW.state_bytes` says what the states take. Every state is a plain tensor, so ``state_dict()`` saves
and loads like AdamW's (``torch.load(weights_only=True)`` included) and a resumed run continues bit for bit.

Sharded parameters (FSDP2) are updated shard by shard, their states kept sharded
(:mod:`fp4train.row_shards`): the NVFP4 states encoded with the whole tensor's scale hold the same bits
as one process's. Their update runs eagerly (the scale's all-reduce sits between the update and the encoding).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import counter_rng, row_shards
from ..row_shards import local
from . import state_codec

_M, _V = "exp_avg", "exp_avg_sq"


class QAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in NVFP4 (see the module docstring). ``quantize_states=False`` keeps them in FP32:
    the same arithmetic as ``torch.optim.AdamW`` (the reference the tests compare with).

    ``compiled=True`` runs each quantized parameter's decode, update and encode as one ``torch.compile``d
    function - a few fused kernels instead of a few hundred small ones per parameter, which is what an eager
    step of a small model spends its time on. Its arithmetic is the eager one's, fused: equal up to the
    rounding of fused float operations. ``multi_tensor=True`` (with ``compiled``) updates all the parameters of a
    shape in one compiled call - the same update mapped over their stacked tensors (``torch.vmap``), each with its
    own tensor scales and keys - instead of one call per parameter."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, quantize_states: bool = True, compiled: bool = False,
                 stochastic_states: bool = True, seed: int = 0, multi_tensor: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"QAdamW: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"QAdamW: betas must be in [0, 1) (got {betas})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      quantize_states=quantize_states))
        self.compiled = compiled
        if multi_tensor and not compiled:
            raise ValueError(f"{type(self).__name__}: multi_tensor=True updates the parameters of a shape in one compiled call; "
                             "it needs compiled=True")
        self.multi_tensor = multi_tensor
        self.stochastic_states, self.seed = stochastic_states, seed
        #: a parameter's position among all the optimizer's parameters: part of its stochastic-rounding keys
        self.position = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for group in self.param_groups:
            for p in group["params"]:
                row_shards.check(p, type(self).__name__, tiles=state_codec.TILE if self._quantized(p, group) else None)

    def state_keys(self, p: torch.Tensor, step: int, which: int) -> torch.Tensor | None:
        """The stochastic-rounding keys of ``p``'s state ``which`` (0, 1: its first, second stored state) at ``step``
        (None: nearest rounding)."""
        if not self.stochastic_states:
            return None
        seed = counter_rng.derive_seed(self.seed, self.position[p], int(step), which)
        return torch.tensor(counter_rng.seed_keys(seed), dtype=torch.int64)

    def _quantized(self, p: torch.Tensor, group: dict) -> bool:
        return group["quantize_states"] and state_codec.fits(p.shape)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._group_step(group)
        return loss

    def _group_step(self, group: dict) -> None:
        """One param group's update (subclasses with other groups dispatch here)."""
        self._adamw_group(group)

    def _adamw_group(self, group: dict) -> None:
        """One param group's AdamW step (see the module docstring)."""
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        # the step's scalars by step count (the same for every parameter of a run), and as device tensors
        per_step: dict[float, dict] = {}
        on_device: dict[tuple, dict] = {}
        batched: dict[tuple, list] = {}  # multi_tensor: the parameters of a step count, shape and dtype, updated together
        with _compile_limit(self.compiled):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QAdamW does not take sparse gradients")
                state = self.state[p]
                step = (state["step"] if "step" in state else torch.zeros((), dtype=torch.float32)) + 1
                t = float(step)
                if t not in per_step:  # as torch.optim.AdamW computes them; b1, b2, eps are fixed for a run
                    per_step[t] = dict(decay=1 - lr * wd, step_size=lr / (1 - b1**t), bias2_sqrt=(1 - b2**t) ** 0.5,
                                       b1=b1, b2=b2, eps=eps)
                scalars = per_step[t]
                pl, g = local(p), local(p.grad)  # a sharded parameter: this process's rows
                if not self._quantized(p, group):
                    m, v = (local(state[_M]), local(state[_V])) if _M in state else _zeros(pl)
                    _adamw_update(pl, g, m, v, **scalars)
                    state.clear()
                    state.update({"step": step, _M: row_shards.like(m, p), _V: row_shards.like(v, p)})
                    continue
                moments = (_sub(state, _M), _sub(state, _V)) if _M + ".codes" in state else None
                keys = (self.state_keys(p, t, 0), self.state_keys(p, t, 1))
                if moments is not None and self.compiled and not row_shards.is_sharded(p):
                    key = (t, p.device)  # the first step (from zero moments) runs eagerly, once
                    if key not in on_device:
                        on_device[key] = _as_tensors(scalars, p.device)
                    if self.multi_tensor:
                        batched.setdefault((t, p.shape, p.dtype, p.device), []).append((p, step, moments, keys))
                        continue
                    keys = tuple(_stacked_keys(keys, p.device).unbind()) if keys[0] is not None else keys
                    stored = _compiled_quantized_update()(pl, g, moments, keys=keys, **on_device[key])
                else:
                    stored = _quantized_update(pl, g, moments, amax_over=row_shards.amax_over(p), keys=keys,
                                               offset=row_shards.element_offset(p), **scalars)
                self._store_moments(p, step, stored)
            for (t, *_, device), items in batched.items():
                params = [p for p, *_ in items]
                keys = [k for *_, k in items]
                keys = _stacked_keys([torch.stack(k) for k in keys], device) if keys[0][0] is not None else None
                new, (m, v) = _compiled_batched_update()(
                    torch.stack(params), torch.stack([p.grad for p in params]), _stacked([ms[0] for _, _, ms, _ in items]),
                    _stacked([ms[1] for _, _, ms, _ in items]), keys, **on_device[(t, device)])
                torch._foreach_copy_(params, list(new.unbind(0)))
                for i, (p, step, *_) in enumerate(items):
                    self._store_moments(p, step, ({k: x[i] for k, x in m.items()}, {k: x[i] for k, x in v.items()}))

    def _store_moments(self, p: torch.Tensor, step: torch.Tensor, stored: tuple[dict, dict]) -> None:
        state = self.state[p]
        state.clear()
        state["step"] = step
        _put(state, _M, {k: row_shards.by_rows(x, p) for k, x in stored[0].items()})
        _put(state, _V, {k: row_shards.by_rows(x, p) for k, x in stored[1].items()})

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping every state tensor's own dtype: the base class casts
        floating states to the parameter's dtype, which would turn the NVFP4 codes into floats and round the FP32
        tile means and scales of a BF16 parameter."""
        saved = {pid: {k: t for k, t in st.items() if isinstance(t, torch.Tensor) and k != "step"}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, t in saved.get(pid, {}).items():
                self.state[p][k] = t.to(device=p.device, copy=True)

    def state_bytes(self) -> int:
        """Bytes the optimizer's moments take in this process (codes, scales, tile means; FP32 moments where not
        quantized)."""
        return sum(local(t).numel() * t.element_size() for st in self.state.values() for k, t in st.items()
                   if k != "step" and isinstance(t, torch.Tensor))


def _zeros(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return z, z.clone()


def _adamw_update(p, g, m, v, *, decay, step_size, bias2_sqrt, b1, b2, eps) -> None:
    """``torch.optim.AdamW``'s single-tensor arithmetic in its order, on FP32 moments ``m``, ``v`` (in place)."""
    g = g.float()
    pf = p.float() if p.dtype != torch.float32 else p
    pf.mul_(decay)
    m.copy_(torch.lerp(m, g, 1 - b1))  # lerp_'s arithmetic; the out-of-place ops are the ones torch.vmap batches
    v.copy_(torch.addcmul(v * b2, g, g, value=1 - b2))
    denom = (v.sqrt() / bias2_sqrt).add_(eps)
    if isinstance(step_size, torch.Tensor):  # compiled: a tensor, which addcdiv's value cannot be
        pf.sub_(m / denom * step_size)
    else:
        pf.addcdiv_(m, denom, value=-step_size)
    if pf is not p:
        p.copy_(pf)


def _quantized_update(p, g, moments: tuple[dict, dict] | None, amax_over=None, keys=(None, None), offset: int = 0, **scalars):
    """One AdamW step of ``p`` from its stored NVFP4 moments (``None``: the first step, from zero moments): decode,
    update, encode; returns the new stored moments (``amax_over``, ``offset``: a sharded parameter's; ``keys``: the
    two states' stochastic-rounding keys or None; see :mod:`fp4train.optim.state_codec`)."""
    if moments is None:
        m, v = _zeros(p)
    else:
        m = state_codec.decode_signed(moments[0], p.shape)
        v = state_codec.decode_second_moment(moments[1], p.shape)
    _adamw_update(p, g, m, v, **scalars)
    return (state_codec.encode_signed(m, amax_over=amax_over, keys=keys[0], offset=offset),
            state_codec.encode_second_moment(v, amax_over=amax_over, keys=keys[1], offset=offset))


#: per-step scalars, given to the compiled update as tensors (a Python float would be compiled in as a constant)
_STEP_SCALARS = ("decay", "step_size", "bias2_sqrt", "step_lr")


def _as_tensors(scalars: dict, device: torch.device, names=_STEP_SCALARS) -> dict:
    """``scalars`` with the per-step ones among ``names`` as FP32 device tensors (one copy to the device)."""
    names = [k for k in names if k in scalars]
    vals = torch.tensor([scalars[k] for k in names], dtype=torch.float32).to(device, non_blocking=True)
    return {**scalars, **dict(zip(names, vals.unbind()))}


#: The codec's layout is a function of the shape, so the update compiles once per state shape (a model has about
#: ten); Inductor's on-disk cache serves later runs.
_RECOMPILE_LIMIT = 64


def _compile_limit(compiled: bool):
    """Room for one compiled update per state shape, for the duration of a step (not a process-wide setting)."""
    return torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT) if compiled else contextlib.nullcontext()


@functools.cache
def _compiled_quantized_update():
    return torch.compile(_quantized_update, dynamic=False)


def _batched_update(ps, gs, m: dict, v: dict, keys: torch.Tensor | None, *, b1, b2, eps, **step):
    """:func:`_quantized_update` of each of the stacked parameters ``ps`` ``[n, ...]`` (with their stacked gradients,
    stored moments and keys ``[n, 2, 2]`` or None), mapped over them: ``(the new parameters, (m, v) stored)``, stacked."""
    def one(p, g, m, v, k, step):
        p = p.clone()
        return p, _quantized_update(p, g, (m, v), keys=(None, None) if k is None else (k[0], k[1]), b1=b1, b2=b2, eps=eps,
                                    **step)

    return torch.vmap(one, in_dims=(0, 0, 0, 0, None if keys is None else 0, None))(ps, gs, m, v, keys, step)


@functools.cache
def _compiled_batched_update():
    return torch.compile(_batched_update, dynamic=False)


def _stacked(stored: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in stored]) for k in stored[0]}


def _stacked_keys(keys, device: torch.device) -> torch.Tensor:
    """Several stochastic-rounding keys as one device tensor (one host-to-device copy)."""
    return torch.stack(list(keys)).to(device, non_blocking=True)


def _put(state: dict, name: str, stored: dict[str, torch.Tensor]) -> None:
    for k, t in stored.items():
        state[f"{name}.{k}"] = t


def _sub(state: dict, name: str) -> dict[str, torch.Tensor]:
    """The stored tensors of state ``name`` (a sharded parameter's: this process's parts)."""
    pre = name + "."
    return {k[len(pre):]: local(t) for k, t in state.items() if k.startswith(pre)}
