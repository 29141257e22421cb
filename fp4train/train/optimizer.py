"""A run's optimizer and learning-rate schedule, from its config.

AdamW (fused on CUDA) with decoupled weight decay on the matrices only; QAdamW (both moments in NVFP4);
Muon or QMuon, Root or QRoot (native NVFP4 Newton-Schulz; ``qroot_bf16ns``: BF16's) on the 2D hidden weights with AdamW on the rest. The schedule: linear warmup, then cosine
decay to ``min_lr_ratio`` of the peak.
"""

from __future__ import annotations

import math

import torch

from ..optim import QAdamW, QMuon, QRoot, muon_groups
from .config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, *, compiled: bool) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters; ``compiled``: the quantized optimizers' steps run compiled. LoRA-SVD
    factors (Full-Stack FP4) train with AdamW at ``cfg.lora_lr_multiplier`` times the learning rate, in a group of
    their own (none when the multiplier is 1, as runs saved before it trained)."""
    lora = _lora_factors(model) if cfg.lora_lr_multiplier != 1.0 else []
    params = [p for p in model.parameters() if all(p is not f for f in lora)]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    lora_group = [{"params": lora, "weight_decay": cfg.weight_decay, "lr": cfg.lr * cfg.lora_lr_multiplier}] if lora else []
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}] + lora_group
    if cfg.optimizer == "qadamw":  # both moments in NVFP4 where a parameter's shape tiles (fp4train.optim)
        return QAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, compiled=compiled)
    if cfg.optimizer in ("muon", "qmuon", "root", "qroot", "qroot_bf16ns"):  # the 2D hidden weights at AdamW's lr
        kind = QRoot if "root" in cfg.optimizer else QMuon
        extra = {"ns_matmul": "bf16"} if cfg.optimizer == "qroot_bf16ns" else {}  # ours: Q-Root with BF16 Newton-Schulz
        return kind(muon_groups(model, cfg.weight_decay, exclude=lora) + lora_group, lr=cfg.lr, betas=cfg.betas, eps=1e-8,
                    quantize_states=cfg.optimizer.startswith("q"), compiled=compiled, **extra)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=device.type == "cuda")


def _lora_factors(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA-SVD layers' low-rank factors (``lora_a``, ``lora_b``)."""
    from ..linear.lora_svd import LoRASVDLinear

    return [p for m in model.modules() if isinstance(m, LoRASVDLinear) for p in (m.lora_a, m.lora_b) if p.requires_grad]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` after ``step`` optimizer steps: linear warmup, cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of :func:`lr_factor` on ``opt``."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
