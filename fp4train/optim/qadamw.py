"""``QAdamW``: AdamW with both moments stored in NVFP4 (Full-Stack FP4's Q-AdamW, docs/methods.md).

The update is AdamW's (decoupled weight decay, bias correction), computed in FP32 from the decoded states:

    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
    p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

after which ``m`` and ``v`` are stored again: ``m`` as NVFP4, ``v`` through the second-moment transform of
:mod:`fp4train.optim.state_codec` (sqrt, tile mean subtracted, block Hadamard, NVFP4). A parameter whose shape
the codec cannot tile (biases, norm weights, odd shapes) keeps FP32 moments, as ``torch.optim.AdamW`` does;
:meth:`QAdamW.state_bytes` says what the states take. Every state is a plain tensor, so ``state_dict()`` saves
and loads like AdamW's (``torch.load(weights_only=True)`` included) and a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch

from . import state_codec

_M, _V = "exp_avg", "exp_avg_sq"


class QAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in NVFP4 (see the module docstring). ``quantize_states=False`` keeps them in FP32:
    the same arithmetic as ``torch.optim.AdamW`` (the reference the tests compare with)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, quantize_states: bool = True):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"QAdamW: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"QAdamW: betas must be in [0, 1) (got {betas})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      quantize_states=quantize_states))

    def _quantized(self, p: torch.Tensor, group: dict) -> bool:
        return group["quantize_states"] and state_codec.fits(p.shape)

    def _moments(self, p: torch.Tensor, state: dict, quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not state:
            z = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            return z, z.clone()
        if quantized:
            return (state_codec.decode_signed(_sub(state, _M), p.shape),
                    state_codec.decode_second_moment(_sub(state, _V), p.shape))
        return state[_M], state[_V]

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
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("QAdamW does not take sparse gradients")
            state = self.state[p]
            quantized = self._quantized(p, group)
            m, v = self._moments(p, state, quantized)
            step = (state["step"] if "step" in state else torch.zeros((), dtype=torch.float32)) + 1
            g = p.grad.float()
            pf = p.float() if p.dtype != torch.float32 else p
            # torch.optim.AdamW's single-tensor arithmetic, in its order (the same bits without quantized states)
            pf.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            t = float(step)
            step_size = lr / (1 - b1**t)
            denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps)
            pf.addcdiv_(m, denom, value=-step_size)
            if pf is not p:
                p.copy_(pf)
            state.clear()
            state["step"] = step
            if quantized:
                _put(state, _M, state_codec.encode_signed(m))
                _put(state, _V, state_codec.encode_second_moment(v))
            else:
                state[_M], state[_V] = m, v

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
        """Bytes the optimizer's moments take (codes, scales, tile means; FP32 moments where not quantized)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for k, t in st.items()
                   if k != "step" and isinstance(t, torch.Tensor))


def _put(state: dict, name: str, stored: dict[str, torch.Tensor]) -> None:
    for k, t in stored.items():
        state[f"{name}.{k}"] = t


def _sub(state: dict, name: str) -> dict[str, torch.Tensor]:
    pre = name + "."
    return {k[len(pre):]: t for k, t in state.items() if k.startswith(pre)}
