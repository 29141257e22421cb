"""Which device a command runs on: ``auto`` (a CUDA GPU where there is one), ``cpu``, ``cuda`` or ``cuda:N``."""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """The ``torch.device`` of ``spec``; a GPU asked for where there is none, or one beyond the machine's, is refused
    naming the fix."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec} asked for, but PyTorch sees no CUDA GPU here; use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: there are only {torch.cuda.device_count()} CUDA GPU(s) (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    return dev
