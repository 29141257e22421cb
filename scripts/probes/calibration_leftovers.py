"""Probe: does AdaHOP's calibration leave tensors alive (a candidate for AdaHOP's peak memory above mxfp4's)?

Runs ``calibrate_in_place`` for ``--steps`` BF16 steps on a model, then counts the bytes of every tensor
the garbage collector can still reach, parameters and buffers left out - before and after.

    python scripts/probes/calibration_leftovers.py --model 20m --steps 3
"""

from __future__ import annotations

import argparse
import gc

import torch

import fp4train
from fp4train import models
from fp4train.adahop.calibration import calibrate_in_place


def live_mib(model: torch.nn.Module) -> tuple[float, int]:
    """(MiB, count) of the distinct storages of reachable tensors that are not the model's parameters or buffers."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in own:
                seen[ptr] = o.untyped_storage().nbytes()
    return sum(seen.values()) / 2**20, len(seen)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = models.build(args.model)
    tokens = torch.randint(0, 1000, (2, 256))

    def step():
        model(tokens, tokens).backward()
        model.zero_grad(set_to_none=True)

    before = live_mib(model)
    cal = calibrate_in_place(model, fp4train.recipes.get("adahop"), step, args.steps)
    gc.collect()
    after = live_mib(model)
    print(f"live tensors besides parameters and buffers: before {before[0]:.3f} MiB ({before[1]}), "
          f"after calibration {after[0]:.3f} MiB ({after[1]}); strategies {cal.strategy_counts()}")


if __name__ == "__main__":
    main()
