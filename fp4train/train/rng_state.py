"""The random states a checkpoint carries, so that a resumed run draws what the uninterrupted run would have:
torch's CPU generator (which also seeds stochastic rounding), the GPU's, Python's, and the device-side seed
streams of runs replayed as CUDA graphs."""

from __future__ import annotations

import random

import torch

from .. import device_seeds


def rng_state(device: torch.device) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "device_seeds": device_seeds.device_seed_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st: dict, device: torch.device) -> None:
    torch.set_rng_state(st["torch"].cpu())  # the checkpoint may have been loaded onto the GPU
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"].cpu(), device)
    device_seeds.load_device_seed_state(st.get("device_seeds", {}))  # compile_mode reduce-overhead's seed streams
