"""Optimizers whose states are stored in FP4 (Full-Stack FP4): drop-in ``torch.optim.Optimizer`` s for any model."""

from .qadamw import QAdamW
from .qmuon import QMuon, QRoot, muon_groups

__all__ = ["QAdamW", "QMuon", "QRoot", "muon_groups"]
