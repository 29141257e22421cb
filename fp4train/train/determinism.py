"""Bitwise-repeatable training on one GPU (``--deterministic``).

The run's own randomness is seeded already (init, data order, stochastic rounding, Hadamard signs), so
what varies between repeats of one seed is summation order in parallel reductions: atomic adds in
kernels (scatter/index-add backward, flash attention's dQ, fp4train's NVFP4 attention dQ) and cuBLAS
workspaces shared between streams. PyTorch's switch, ``torch.use_deterministic_algorithms``, picks
atomic-free kernels where they exist and refuses ops that have none; fp4train's own kernels read the
same switch (:mod:`fp4train.kernels.attention`; the other kernels' atomics are integer counts and
maxima, exact in any order). The switch is process-wide in PyTorch, so a run turns it on for its
duration and restores what was there before.
"""

from __future__ import annotations

import contextlib
import os

import torch

#: cuBLAS's workspace setting for reproducible results (NVIDIA's cuBLAS docs, "Results reproducibility")
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """Within the block: PyTorch's deterministic algorithms (an op without one raises, naming itself), cuDNN's
    deterministic kernels without autotuning, and a fixed cuBLAS workspace. Restores the previous settings after.
    ``CUBLAS_WORKSPACE_CONFIG`` is read when cuBLAS is first used in the process: it is set here if unset, and
    a value that is not one of the reproducible ones is refused."""
    if not enabled:
        yield
        return
    ws = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if ws is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    elif ws not in (":4096:8", ":16:8"):
        raise ValueError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={ws} does not give reproducible cuBLAS results; "
                         f"unset it or set it to {CUBLAS_WORKSPACE}")
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[2], was[3]
