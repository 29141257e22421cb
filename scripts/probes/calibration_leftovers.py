"""Probe: does AdaHOP's calibration leave tensors alive (a candidate for AdaHOP's peak memory above mxfp4's)?

Runs ``calibrate_in_place`` for ``--steps`` BF16 steps on a model, then counts the bytes of every tensor
the garbage collector can still reach, parameters and buffers left out - before and after.

    python scripts/probes/calibration_leftovers.py --model 20m --steps 3
"""

from __future__ import annotations

import argparse
import gc

import torch
from live_tensors_per_step import live_mib  # same folder: the probe that also leaves gradients and optimizer state out

import fp4train
from fp4train import models
from fp4train.adahop.calibration import calibrate_in_place


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
