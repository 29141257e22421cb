"""Full-Stack FP4's realignment in a training run: the feature (:class:`fp4train.features.Feature`) that
recomputes every LoRA-SVD layer's split from a fresh randomized SVD every ``LoRASVDSpec.realign_every``
optimizer steps and drops the factors' optimizer state (see :func:`fp4train.linear.lora_svd.realign`).

The SVD of step ``s`` is seeded with ``seed + s``, so a resumed run realigns as the uninterrupted one did and
the feature has no state of its own to checkpoint."""

from __future__ import annotations

from ..features import Feature
from .lora_svd import realign


class LoRASVDRealignment(Feature):
    """Realign every ``every`` optimizer steps."""

    def __init__(self, every: int):
        self.every = every

    @classmethod
    def for_run(cls, recipe, cfg) -> LoRASVDRealignment | None:
        lora = recipe.lora_svd
        return cls(lora.realign_every) if lora is not None and lora.realign_every else None

    def after_step(self, run) -> None:
        if run.step % self.every == 0:
            n = realign(run.model, run.opt, seed=run.cfg.seed + run.step)
            run.log(f"fp4train: step {run.step}: LoRA-SVD realigned {n} layers (a fresh randomized SVD; the factors' "
                    "optimizer state restarts)")
