"""Probe: do a recipe's live tensors grow from one training step to the next (a leak)?

AdaHOP's peak in ``bench/train_speed.py`` (3 warm-up + 8 timed steps) sat 9 GiB above mxfp4's at 1b,
while ``bench/memory_peak.py`` found its third step peaking no higher than mxfp4's. A per-step leak
would explain both. Trains ``--steps`` AdamW steps per recipe (AdaHOP calibrated first) and prints the
bytes of every tensor the garbage collector can reach after each step, parameters, their gradients
and the optimizer's state left out.

    python scripts/probes/live_tensors_per_step.py --model 20m --recipes mxfp4,adahop --steps 6 [--compile] [--backend triton]
"""

from __future__ import annotations

import argparse
import gc

import torch

import fp4train
from fp4train import models


def live_mib(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[float, int]:
    """(MiB, count) of the distinct storages of reachable tensors other than parameters, buffers,
    gradients and optimizer state."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    own |= {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
    seen = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.device.type != "meta":
            ptr = o.untyped_storage().data_ptr()
            if ptr not in own and ptr:
                seen[ptr] = o.untyped_storage().nbytes()
    return sum(seen.values()) / 2**20, len(seen)


def run(model_name: str, recipe_name: str, steps: int, compile_: bool, batch: int, seq: int, backend: str | None = None) -> list[tuple[float, int]]:
    torch.manual_seed(0)
    model = models.build(model_name, max_seq_len=max(seq, 64))
    recipe = fp4train.recipes.get(recipe_name)
    fp4train.convert(model, recipe, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def step(fwd=model):
        fwd(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if recipe.calibrate:
        from fp4train.adahop.calibration import calibrate_in_place

        calibrate_in_place(model, recipe, step, 2, backend=backend)
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
