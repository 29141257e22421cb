"""What each linear of a model does, found from the model itself rather than from its layers' names.

A recipe's overrides may name a role instead of a name pattern (``Override("role:query", ...)``), so that they
mean the same on every architecture: Llama's ``q_proj``, Phi-3's fused ``qkv_proj``, GPT-2's ``c_attn``, BERT's
``query``. The roles:

* ``query``, ``key``, ``value``: the linears whose outputs become attention's Q, K and V (a fused projection has
  all three);
* ``attn_output``: the linears that read attention's output (the output projection);
* ``lm_head``: the linear whose outputs are the model's vocabulary logits (its weight tied to the input embedding,
  or shaped ``[vocab, hidden]`` as the input embedding is).

Attention's roles come from one forward pass of a few tokens (:func:`linear_roles`), followed through the
model: every tensor an operation makes carries the linears it came from (a linear's output starts afresh with its
own name), and the call to attention (PyTorch's ``scaled_dot_product_attention`` or fp4train's NVFP4 attention)
says which linears fed Q, K and V. A model that cannot run such a pass (one that takes no token ids) has its
attention roles from the usual names (:data:`~fp4train.recipes.spec.NAME_FALLBACK`), and :func:`linear_roles` says so.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .recipes.spec import NAME_FALLBACK, ROLES

__all__ = ["NAME_FALLBACK", "ROLES", "input_embedding", "is_linear", "linear_roles", "lm_heads"]

_ATTENTION = "@attention"  # the label of attention's output
PROBE_TOKENS = 8


def is_linear(module: nn.Module) -> bool:
    """A linear layer convert() handles: ``nn.Linear``, transformers' ``Conv1D``, or fp4train's quantized ones."""
    from .linear.conv1d import is_conv1d
    from .linear.module import QuantizedLinear

    return isinstance(module, (nn.Linear, QuantizedLinear)) or is_conv1d(module)


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding: a Hugging Face model's ``get_input_embeddings()``, else the largest ``nn.Embedding``."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(embs, key=lambda m: m.num_embeddings) if embs else None


def lm_heads(model: nn.Module) -> set[str]:
    """The linears producing vocabulary logits: their weight is the input embedding's (tied), or, outside the
    repeated blocks (a layer of a block - an MLP as wide as the vocabulary - is no head), shaped as it is."""
    import re

    from .linear.conv1d import in_out

    emb = input_embedding(model)
    if emb is None:
        return set()
    out = set()
    for name, m in model.named_modules():
        if not is_linear(m):
            continue
        in_block = re.search(r"\.\d+\.", f".{name}.") is not None
        if m.weight is emb.weight or (not in_block and in_out(m) == (emb.embedding_dim, emb.num_embeddings)):
            out.add(name)
    return out


class RolesFound(dict):
    """``{module name: frozenset of roles}`` for every linear that has one; ``how``: ``"forward"`` (attention's roles
    traced through a forward pass) or ``"names"`` (from :data:`NAME_FALLBACK`, and why in ``why``)."""

    how: str = "forward"
    why: str = ""


def linear_roles(model: nn.Module) -> RolesFound:
    """Every linear's roles in ``model`` (see the module docstring). Runs one forward pass of
    :data:`PROBE_TOKENS` tokens without gradients when the model takes token ids (fp4train's Llama, a Hugging Face
    model); leaves the model as it was."""
    found = RolesFound()
    for name in lm_heads(model):
        found[name] = frozenset({"lm_head"})
    traced, why = _traced_attention_roles(model)
    if traced is None:
        found.how, found.why = "names", why
        for name, m in model.named_modules():
            if is_linear(m):
                roles = {r for r, pats in NAME_FALLBACK.items() if r != "lm_head" and any(fnmatch.fnmatchcase(name, p) for p in pats)}
                if roles:
                    found[name] = found.get(name, frozenset()) | roles
        return found
    for name, roles in traced.items():
        found[name] = found.get(name, frozenset()) | roles
    return found


def _probe_input(model: nn.Module) -> tuple[torch.Tensor | None, str]:
    emb = input_embedding(model)
    if emb is None:
        return None, "the model has no token embedding to feed"
    if emb.weight.device.type == "meta":
        return None, "the model's weights are on the meta device"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, emb.num_embeddings, (1, PROBE_TOKENS), generator=g).to(emb.weight.device)
    return ids, ""


@contextmanager
def _sdpa_attention(model: nn.Module):
    """A Hugging Face model's attention through SDPA for the probe (an eager implementation does its own matmuls),
    restored after."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    from .attention import HF_NAME

    if impl is None or impl in ("sdpa", HF_NAME):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = impl


def _traced_attention_roles(model: nn.Module) -> tuple[dict[str, frozenset] | None, str]:
    ids, why = _probe_input(model)
    if ids is None:
        return None, why
    names = {m: n for n, m in model.named_modules() if is_linear(m)}
    tracer = _LabelTracer()
    hooks = []
    for m, n in names.items():
        hooks.append(m.register_forward_pre_hook(lambda mod, args, n=n: tracer.reads(n, args)))
        hooks.append(m.register_forward_hook(lambda mod, args, out, n=n: tracer.starts(n, out)))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), _sdpa_attention(model), tracer:
            try:
                model(ids)
            except Exception as e:  # noqa: BLE001 - any model's own error: say it, fall back to names
                return None, f"a forward pass of {PROBE_TOKENS} token ids failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    if not tracer.calls:
        return None, "the forward pass called no attention fp4train recognizes (scaled_dot_product_attention, nvfp4_attention)"
    return tracer.roles, ""


class _LabelTracer(TorchFunctionMode):
    """Carries, for every tensor made during a forward pass, the names of the linears it came from."""

    def __init__(self):
        super().__init__()
        self.labels: dict[int, frozenset] = {}
        self.keep: list[torch.Tensor] = []  # alive until the pass ends, so that no id is reused
        self.roles: dict[str, frozenset] = {}
        self.calls = 0

    def _of(self, args) -> frozenset:
        out = frozenset()
        for t in tree_flatten(args)[0]:
            if isinstance(t, torch.Tensor):
                out |= self.labels.get(id(t), frozenset())
        return out

    def _set(self, outputs, labels: frozenset) -> None:
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                self.labels[id(t)] = labels
                self.keep.append(t)

    def _add(self, name: str, role: str) -> None:
        self.roles[name] = self.roles.get(name, frozenset()) | {role}

    def reads(self, name: str, args) -> None:
        if _ATTENTION in self._of(args):
            self._add(name, "attn_output")

    def starts(self, name: str, out) -> None:
        self._set(out, frozenset({name}))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fname = getattr(func, "__name__", "") or str(func)
        if "scaled_dot_product_attention" in fname or "nvfp4_attention" in str(func):
            self.calls += 1
            q, k, v = (args + tuple(kwargs.get(n) for n in ("query", "key", "value")))[:3]
            for t, role in ((q, "query"), (k, "key"), (v, "value")):
                for name in self._of((t,)) - {_ATTENTION}:
                    self._add(name, role)
            self._set(out, frozenset({_ATTENTION}))
        else:
            self._set(out, self._of((args, kwargs)))
        return out
