"""A mixture-of-experts feed-forward block for fp4train's decoder (the ``moe-*`` model presets).

Mixtral's design, in Hugging Face's module layout so recipes and checkpoints read the same on both: a router
``gate`` (a linear of one output per expert, kept in high precision by ``convert``) picks ``experts_per_token`` of
``n_experts`` SwiGLU experts per token, their outputs weighted by the router's softmax renormalized over the chosen
ones. The experts' weights are stacked 3-D parameters (``experts.gate_up_proj [E, 2F, D]``,
``experts.down_proj [E, D, F]``), run through :func:`fp4train.linear.experts.experts_forward` - the same path a
transformers MoE model takes, so ``convert`` quantizes every expert's GEMMs with the recipe's numerics.

Training adds Switch Transformer's load-balancing loss (arXiv 2101.03961), ``E * sum_e f_e P_e`` (``f_e``: the
share of the token-to-expert assignments expert ``e`` got, ``P_e``: its mean router probability; 1 when balanced),
times ``router_aux_loss_coef``, to the training loss; evaluation reports cross-entropy alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear.experts import experts_forward


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts as stacked weights, in transformers 5's experts layout (not transposed, no
    bias, gate and up fused: ``gate_up_proj[e] = [W_gate; W_up]``)."""

    has_gate, is_transposed, has_bias = True, False, False

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.num_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.act_fn = F.silu

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self, x, top_k_index, top_k_weights)


class MoE(nn.Module):
    """The router and the experts; ``forward(x)`` is the block's feed-forward output, and in training keeps the
    load-balancing loss of that call as ``aux_loss`` (None in evaluation)."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, experts_per_token: int):
        super().__init__()
        self.top_k = experts_per_token
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, ffn_dim)
        self.aux_loss: torch.Tensor | None = None

    def _balance_loss(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        n = self.experts.num_experts
        share = F.one_hot(index, n).float().mean(dim=(0, 1))  # f_e: each expert's share of the assignments
        return n * (share * probs.mean(dim=0)).sum()

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's choice for tokens ``h`` ``[T, D]``: ``(weights [T, k] in h's dtype, renormalized over the
        chosen experts; index [T, k]; probs [T, E], FP32)``."""
        probs = F.softmax(self.gate(h).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype), index, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, index, probs = self.route(h)
        self.aux_loss = self._balance_loss(probs, index) if self.training else None
        return self.experts(h, index, weights).reshape(shape)
