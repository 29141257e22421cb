"""Training: config, checkpoints, the loop, and recipe comparison."""

from ..checkpoint import CheckpointError, Checkpoints
from .config import TrainConfig
from .trainer import Trainer, TrainingDiverged, train

__all__ = ["CheckpointError", "Checkpoints", "TrainConfig", "Trainer", "TrainingDiverged", "train"]
