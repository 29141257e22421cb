"""A mixture of experts' stacked expert weights with quantized GEMMs: every expert runs the recipe's numerics.

transformers 5 stores a MoE block's experts as 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
Mixtral, Qwen2-MoE, ...) in a module whose forward it dispatches through its experts interface
(``config._experts_implementation``). :func:`convert <fp4train.convert>` gives such a module its
:class:`QuantizedExperts` (the specs of its two projections) and switches the implementation to
:data:`HF_NAME`, :func:`experts_forward`: the tokens routed to each expert run that expert's ``gate_up`` and
``down`` GEMMs through fp4train's quantized linear op, exactly as that expert's weights would as a quantized
linear layer of their own (tested), and are combined with the router's weights as transformers' own loop does.
The parameters stay where they are (the state dict does not change); the router stays in high precision.

The tokens are sorted by expert and each projection runs as grouped GEMMs over all experts
(:mod:`fp4train.linear.grouped_linear`); a recipe with AdaHOP's outlier extraction, or seeds drawn on the device,
runs the experts one after another instead (one pair of quantized linear calls per expert that has tokens).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..recipes.spec import LinearSpec
from .grouped_linear import GroupedLinear, groupable
from .op import LayerConfig, call_settings, config_key

HF_NAME = "fp4train"


def is_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module: stacked 3-D expert weights, its forward dispatched by its experts interface."""
    down = getattr(module, "down_proj", None)
    return (isinstance(down, nn.Parameter) and down.ndim == 3 and hasattr(module, "has_gate") and hasattr(module, "is_transposed")
            and hasattr(module, "num_experts"))


def projections(module: nn.Module) -> dict[str, nn.Parameter]:
    """The expert weights a quantized GEMM runs: ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return {first: getattr(module, first), "down_proj": module.down_proj}


def dims(module: nn.Module, name: str) -> tuple[int, int]:
    """``(in, out)`` of one expert's GEMM ``name``."""
    w = getattr(module, name)
    return (w.shape[1], w.shape[2]) if module.is_transposed else (w.shape[2], w.shape[1])


def mixtures_of_experts(model: nn.Module) -> tuple[list, dict[str, str]]:
    """The experts modules (stacked 3-D expert weights) and, beside each, the router and gates that stay in high
    precision: ``(experts [(name, module)], {name: why kept})``. A router is the block's module whose weight has a
    row per expert; a gate is a linear of one output (Qwen2-MoE's shared-expert gate)."""
    experts = [(n, m) for n, m in model.named_modules() if is_experts(m)]
    kept = {}
    for name, mod in experts:
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for child, m in parent.named_children():
            full = f"{parent_name}.{child}" if parent_name else child
            w = getattr(m, "weight", None)
            if m is mod or not isinstance(w, torch.Tensor) or w.ndim != 2:
                continue
            if w.shape[0] == mod.num_experts:
                kept[full] = "a mixture of experts' router: kept in high precision (its choices move with its rounding)"
            elif isinstance(m, nn.Linear) and m.out_features == 1:
                kept[full] = "a mixture of experts' gate of one output: kept in high precision"
    return experts, kept


#: An expert's tokens go to its quantized GEMMs zero-padded to whole groups of this many rows: an expert gets any
#: number of tokens, and the FP8 tensor-core GEMMs take M (and, for dW, the inner dim) in 128-row groups. Exact:
#: zero rows leave every block's scale alone, and their outputs and gradients are dropped.
ROW_GROUP = 128


class _Gemm:
    """One projection's quantized GEMM, for any expert's slice of the stacked weight."""

    def __init__(self, spec: LinearSpec, backend: str, numerics: str, device_seeds: bool):
        self.spec = spec
        self.key = config_key(LayerConfig(spec, backend, numerics, device_seeds))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.spec.quantized:
            return F.linear(x, w, bias)
        m = x.shape[0]
        xp = F.pad(x, (0, 0, 0, -m % ROW_GROUP)) if m % ROW_GROUP else x  # no copy for a whole number of groups
        return torch.ops.fp4train.quantized_linear(xp, w, bias, self.key, *call_settings(x, w), [])[0][:m]


class QuantizedExperts:
    """The quantized GEMMs of an experts module (``specs``: per projection name, :func:`projections`); attached to it
    as ``fp4train_experts`` by ``convert``. Not a module: it holds no parameters and leaves the state dict alone."""

    def __init__(self, specs: dict[str, LinearSpec], backend: str, numerics: str, device_seeds: bool = False):
        from .. import backends

        backend = backends.resolve(backend)
        self.specs = specs
        self.gemms = {n: _Gemm(s, backend, numerics, device_seeds) for n, s in specs.items()}
        #: every projection's grouped GEMMs, or None where one cannot be grouped (the experts then run one by one)
        self.grouped = ({n: GroupedLinear(s, numerics) for n, s in specs.items()}
                        if all(groupable(s, device_seeds) for s in specs.values()) else None)

    def __repr__(self) -> str:
        return f"QuantizedExperts({', '.join(self.specs)})"


def _weight(module: nn.Module, name: str, e: int) -> torch.Tensor:
    w = getattr(module, name)[e]
    return w.mT if module.is_transposed else w  # [out, in]


def _bias(module: nn.Module, name: str, e: int) -> torch.Tensor | None:
    b = _biases(module, name)
    return None if b is None else b[e]


def _biases(module: nn.Module, name: str) -> torch.Tensor | None:
    """Every expert's bias of projection ``name`` (``[E, out]``), or None."""
    return getattr(module, f"{name}_bias", None) if module.has_bias else None


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: each expert's tokens through its (quantized) GEMMs, weighted by the router
    and summed per token, in transformers' own order (:mod:`transformers.integrations.moe`)."""
    q = getattr(module, "fp4train_experts", None)
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{type(module).__name__}: fp4train's experts do not implement a post-expert norm; keep this "
                         "model's experts in high precision")
    first = "gate_up_proj" if module.has_gate else "up_proj"
    if q is not None:
        return _quantized_forward(module, q, first, hidden_states, top_k_index, top_k_weights)
    return _looped_forward(module, q, first, hidden_states, top_k_index, top_k_weights)


@torch.compiler.disable
def _quantized_forward(module: nn.Module, q: QuantizedExperts, first: str, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Quantized experts, grouped where they can be, else looped - eagerly, also inside a compiled model (a graph
    break there): their groups' sizes are read on the host every step, and each expert's operands are prepared
    by calls that a compiled graph would recompile for every new size."""
    if q.grouped is not None:
        return _grouped_forward(module, q, first, hidden_states, top_k_index, top_k_weights)
    return _looped_forward(module, q, first, hidden_states, top_k_index, top_k_weights)


def _looped_forward(module: nn.Module, q: QuantizedExperts | None, first: str, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts one after another (transformers' loop), each through its quantized GEMMs where ``q`` is given."""
    def gemm(name, x, e):
        w, b = _weight(module, name, e), _bias(module, name, e)
        return q.gemms[name](x, w, b) if q is not None else F.linear(x, w, b)

    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        if e == module.num_experts:  # an expert-parallel sentinel
            continue
        pos, tok = torch.where(mask[e])
        h = gemm(first, hidden_states[tok], e)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        y = gemm("down_proj", h, e) * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _grouped_forward(module: nn.Module, q: QuantizedExperts, first: str, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`experts_forward` as grouped GEMMs: the (token, choice) pairs sorted by expert (then token, then
    choice), each expert's rows zero-padded to whole :data:`ROW_GROUP` s."""
    n_experts, k = module.num_experts, top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    with torch.no_grad():
        counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]  # an expert-parallel sentinel dropped
        order = torch.argsort(flat, stable=True)
        counts_host = counts.tolist()  # the groups' sizes: one sync, as the experts' loop has
        sizes = [c + (-c % ROW_GROUP) for c in counts_host]
        order = order[:sum(counts_host)]
        padding_before = [0, *itertools.accumulate(s - c for s, c in zip(sizes, counts_host))][:-1]
        shift = torch.tensor(padding_before, device=flat.device)
        dest = torch.arange(order.numel(), device=flat.device) + shift[flat[order]]  # each pair's padded row
    tok, pos = order // k, order % k
    x = hidden_states.new_zeros((sum(sizes), hidden_states.shape[1])).index_copy(0, dest, hidden_states[tok])
    h = q.grouped[first](x, getattr(module, first), _biases(module, first), sizes, module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    if module.has_bias:  # padding rows stay zero (their bias would reach the scales of blocks along the tokens)
        h = h * torch.zeros(h.shape[0], 1, device=h.device, dtype=h.dtype).index_fill(0, dest, 1)
    y = q.grouped["down_proj"](h, module.down_proj, _biases(module, "down_proj"), sizes, module.is_transposed)
    y = y[dest] * top_k_weights[tok, pos, None]
    return torch.zeros_like(hidden_states).index_add(0, tok, y.to(hidden_states.dtype))


def register_hf() -> None:
    """Register :func:`experts_forward` with transformers' experts interface as :data:`HF_NAME`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if HF_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(HF_NAME, experts_forward)
