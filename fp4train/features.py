"""Training features: the parts of a run that belong to a method, not to the training loop.

A method that needs more than a recipe - AdaHOP calibrates over its first steps and then swaps its layers,
Full-Stack FP4's LoRA-SVD realigns its subspace every few steps - gives the trainer a :class:`Feature`. The
trainer composes the run's features and calls each at fixed points of the run; it knows none of them by
name. A feature acts through the run it is handed (``run``, a :class:`~fp4train.train.trainer.Trainer`), whose
parts it may read and use:

* ``run.cfg``, ``run.recipe``, ``run.model``, ``run.opt`` (the optimizer), ``run.step`` (optimizer steps
  done), ``run.out`` (the run directory), ``run.device``, ``run.ranks`` (``main``, ``broadcast``, ...),
  ``run.log(msg)``;
* ``run.reconvert(recipe)``: convert the model's layers to another recipe, as the run converted them.

The points, in the order of a run:

1. :meth:`Feature.convert_options` - extra arguments of the run's :func:`~fp4train.convert`;
2. :meth:`Feature.start` - the model, the optimizer and the schedule are built (a resumed run's state is not
   loaded yet);
3. :meth:`Feature.load_state_dict` - resuming: the checkpoint, before the model's and the optimizer's tensors
   are loaded into them;
4. per optimizer step, :meth:`Feature.before_step` (the step's gradients are in place and clipped) and
   :meth:`Feature.after_step` (the optimizer and the schedule have stepped, ``run.step`` counts the step);
5. :meth:`Feature.state_dict` - each checkpoint; :meth:`Feature.summary` - the run's ``summary.json``.

While any feature :meth:`~Feature.holds_model` (it will still change the model's layers), the trainer
runs the model as it is - whole under ``--parallel fsdp``, eagerly - and shards and compiles it once no
feature holds it, with the optimizer's state carried over.

This module imports nothing of fp4train: a method's package may define its features without importing
the trainer.
"""

from __future__ import annotations

from typing import ClassVar


class Feature:
    """A part of a run that belongs to a method. Every hook does nothing unless a subclass overrides it.

    ``SUMMARY``: the keys this kind of feature adds to a run's summary, with the value a run without it
    reports, so that every run's summary has the same keys."""

    SUMMARY: ClassVar[dict] = {}

    @classmethod
    def for_run(cls, recipe, cfg) -> Feature | None:
        """The feature a run of ``recipe`` with config ``cfg`` needs (None: none). Refuses, before any work, a
        config with which the feature cannot work, naming the option and the fix."""
        return None

    def convert_options(self) -> dict:
        """Extra keyword arguments of the run's :func:`~fp4train.convert`."""
        return {}

    def holds_model(self) -> bool:
        """Will this feature still change the model's layers? The trainer then neither shards nor compiles it."""
        return False

    def start(self, run) -> None:
        """The model, the optimizer and the schedule are built; no step has run."""

    def before_step(self, run) -> None:
        """This step's gradients are in place (clipped); the optimizer has not stepped."""

    def after_step(self, run) -> None:
        """The optimizer and the schedule have stepped, the gradients are cleared and ``run.step`` counts the step."""

    def state_dict(self) -> dict:
        """What this feature adds to a checkpoint: entries at its top level, under keys no other part uses."""
        return {}

    def load_state_dict(self, checkpoint: dict, run) -> None:
        """Resuming from ``checkpoint`` (the whole of it: the feature reads its own keys; a checkpoint written
        before the feature existed has none)."""

    def summary(self) -> dict:
        """What this feature adds to the run's summary (its ``SUMMARY`` keys)."""
        return {}

    def done_note(self) -> str:
        """Words added after the step count in the run's last line, e.g. ``" (20 of them BF16 calibration)"``."""
        return ""
