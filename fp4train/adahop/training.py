"""AdaHOP in a training run: the feature (:class:`fp4train.features.Feature`) that calibrates and swaps.

Over the recipe's first ``calibration_steps`` steps the model trains in BF16 while a
:class:`~fp4train.adahop.calibration.PatternRecorder` classifies every quantizable layer's operands; then every
process takes rank 0's :class:`~fp4train.adahop.calibration.Calibration` (all run the same strategies), the
layers are converted to the calibrated recipe, and the table is saved as ``adahop_calibration.json`` in the
run directory. Until then the feature holds the model: the trainer keeps it whole (``--parallel fsdp``) and
eager, and shards and compiles it after the swap. A saved table (``--calibration FILE``) is applied before the
first step instead.

Checkpoints keep the recorder's patterns during calibration (``adahop_recorder``) and the table after it
(``adahop_calibration``), so a run stopped in either phase resumes exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from ..features import Feature
from .calibration import Calibration, PatternRecorder, check_calibratable

CALIBRATION_FILE = "adahop_calibration.json"


class AdaHOPCalibration(Feature):
    """A calibrating recipe's calibration phase; ``saved``: the path of a calibration to apply instead."""

    SUMMARY: ClassVar[dict] = {"bf16_steps": 0, "calibration_peak_mem_gib": None}

    def __init__(self, recipe, saved: str | None = None):
        self.recipe, self.saved = recipe, saved
        self.calibration: Calibration | None = None  # once applied
        self.recorder: PatternRecorder | None = None  # while calibrating
        self.bf16_steps = 0  # steps this run spent in BF16 calibration
        self.peak_gib: float | None = None  # the peak memory of those steps, on a GPU

    @classmethod
    def for_run(cls, recipe, cfg) -> AdaHOPCalibration | None:
        if not recipe.calibrate:
            return None
        if not cfg.calibration and cfg.max_steps <= recipe.calibration_steps:
            raise ValueError(f"recipe {recipe.name!r} spends its first {recipe.calibration_steps} steps calibrating in BF16, "
                             f"and --max-steps {cfg.max_steps} would end the run before any FP4 step: give more steps, or a "
                             "saved calibration with --calibration FILE")
        if cfg.calibration and not Path(cfg.calibration).is_file():
            raise FileNotFoundError(f"--calibration {cfg.calibration} does not exist (an {CALIBRATION_FILE} of an earlier run)")
        return cls(recipe, cfg.calibration)

    def convert_options(self) -> dict:
        return {"calibrating": True}  # the layers run BF16 until the calibration gives them their strategies

    def holds_model(self) -> bool:
        return self.calibration is None

    def start(self, run) -> None:
        if self.saved:
            self._apply(Calibration.load(self.saved), run)
        else:
            # the calibration steps run eagerly: the recorder's hooks (one per layer, each reading its tensors on the
            # host) would make the compiler trace and recompile the model once per layer; it compiles once, after
            check_calibratable(run.model, self.recipe)  # before the first calibration step, not after the last
            self.recorder = PatternRecorder.for_recipe(run.model, self.recipe).attach()

    def after_step(self, run) -> None:
        if self.recorder is None:
            return
        self.recorder.steps += 1
        if run.step >= self.recipe.calibration_steps:
            self._finish(run)

    def _finish(self, run) -> None:
        cal = run.ranks.broadcast(self.recorder.result())  # rank 0's patterns: every rank runs the same strategies
        if run.device.type == "cuda":
            # the eager BF16 calibration steps peak above the compiled FP4 steps that follow; both are reported
            self.peak_gib = torch.cuda.max_memory_allocated(run.device) / 2**30
            torch.cuda.reset_peak_memory_stats(run.device)
        self._apply(cal, run)
        self.bf16_steps = cal.steps
        if run.ranks.main:
            cal.save(run.out / CALIBRATION_FILE)
        run.log(f"fp4train: AdaHOP calibrated over {cal.steps} steps ({cal.mode}): GEMM strategies {cal.strategy_counts()}; "
                f"table in {run.out / CALIBRATION_FILE}")

    def _apply(self, cal: Calibration, run) -> None:
        """Swap every calibrated layer to its strategies (its parameters are kept)."""
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None
        self.calibration = cal
        run.reconvert(cal.recipe(self.recipe.name, base=self.recipe))

    def state_dict(self) -> dict:
        return {"adahop_calibration": self.calibration.to_dict() if self.calibration else None,
                "adahop_recorder": self.recorder.state_dict() if self.recorder else None}

    def load_state_dict(self, checkpoint: dict, run) -> None:
        saved, recorded = checkpoint.get("adahop_calibration"), checkpoint.get("adahop_recorder")
        if saved and self.calibration is not None:  # this run applied --calibration at its start
            if Calibration.from_dict(saved).to_dict() != self.calibration.to_dict():
                raise ValueError("cannot resume: the checkpoint's AdaHOP calibration is not the one this run loaded "
                                 "(--calibration); resume with the run's own settings")
        elif saved:
            self._apply(Calibration.from_dict(saved), run)
            self.bf16_steps = self.calibration.steps
        elif recorded and self.recorder is not None:
            self.recorder.load_state_dict(recorded)
        elif recorded:
            raise ValueError(f"cannot resume: the checkpoint was written during AdaHOP's calibration (step "
                             f"{recorded['steps']} of {self.recipe.calibration_steps}), and this run was given --calibration "
                             f"{self.saved}; resume without --calibration")

    def summary(self) -> dict:
        return {"bf16_steps": self.bf16_steps, "calibration_peak_mem_gib": self.peak_gib}

    def done_note(self) -> str:
        if not self.bf16_steps:
            return ""
        peak = f", at a peak of {self.peak_gib:.2f} GiB" if self.peak_gib else ""
        return f" ({self.bf16_steps} of them BF16 calibration{peak})"
