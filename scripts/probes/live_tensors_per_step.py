"""Probe: do a recipe's live tensors grow from one training step to the next (a leak)?

AdaHOP's peak in ``bench/train_speed.py`` (3 warm-up + 8 timed steps) sits 8.9 GiB above mxfp4's at 1b,
while ``bench/memory_peak.py`` found AdaHOP's first three steps peaking at about train_speed's mxfp4 figure.
A per-step leak would explain both. Runs ``train_speed``'s setup (AdaHOP calibrated first), trains
``--steps`` AdamW steps per recipe and prints the bytes of every tensor the garbage collector can reach
after each step, parameters, their gradients and the optimizer's state left out.

    python scripts/probes/live_tensors_per_step.py --model 20m --recipes mxfp4,adahop --steps 6 [--compile] [--backend triton]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from train_speed import setup  # noqa: E402 - the benchmark's own run


def live_mib(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple[float, int]:
    """(MiB, count) of the distinct storages of reachable tensors other than parameters, buffers,
    gradients and (with ``opt``) optimizer state."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    states = opt.state.values() if opt is not None else ()
    own |= {v.untyped_storage().data_ptr() for st in states for v in st.values() if torch.is_tensor(v)}
    seen = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.device.type != "meta":
            ptr = o.untyped_storage().data_ptr()
            if ptr not in own and ptr:
                seen[ptr] = o.untyped_storage().nbytes()
    return sum(seen.values()) / 2**20, len(seen)


def run(model_name: str, recipe_name: str, steps: int, compile_: bool, batch: int, seq: int, backend: str | None = None) -> list[tuple[float, int]]:
    """Live tensors after each of ``steps`` steps of ``bench/train_speed.py``'s run (AdaHOP: 2 calibration steps)."""
    model, opt, step, _ = setup(model_name, recipe_name, batch, seq, torch.device("cpu"), backend, calibration_steps=2)
    fwd = torch.compile(model) if compile_ else model
    out = []
    for _ in range(steps):
        step(fwd)
        gc.collect()
        out.append(live_mib(model, opt))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m")
    ap.add_argument("--recipes", default="mxfp4,adahop")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default=None, help="e.g. triton (on a CPU: with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    for r in args.recipes.split(","):
        sizes = run(args.model, r, args.steps, args.compile, args.batch_size, args.seq_len, args.backend)
        print(f"{r:>14}: live MiB after each step " + ", ".join(f"{m:.2f} ({n})" for m, n in sizes), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
