"""Probe: how many tensor ops (each a kernel on a GPU) a seeded layer call spends on deriving its seeds on the
device, with the reference's int64 tensor ops (``counter_rng.derive_seed_tensor``/``seed_keys_tensor``) and with
the one-launch Triton kernels (``fp4train/kernels/seeds.py``, what a GPU runs).

A tib2d layer (stochastic rounding of dY) and an nvfp4 layer (also random Hadamard signs) do one forward and one
backward with seeds from the device's stream; every ATen op and Triton launch inside the stream's ``next`` and
``derived_keys_tensor`` is counted. Runs on the CPU: the reference path as it is, the kernel path under Triton's
interpreter (a launch is one op; the interpreter's own tensor traffic inside it is not counted).

    python scripts/probes/seed_ops.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp4train
from fp4train import counter_rng
from fp4train.linear import module as qmod


_IN_LAUNCH = [False]  # inside a launch the interpreter's own tensor traffic is not the GPU's: not counted


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not _IN_LAUNCH[0]
        return func(*args, **(kwargs or {}))


def seed_ops_per_call(recipe: str, kernels: bool) -> dict:
    """Ops spent on seeds in one forward + backward of one ``recipe`` layer with device seeds."""
    counts = {"ops": 0, "derivations": 0}
    launches = []
    if kernels:
        import triton

        real_run = triton.runtime.interpreter.InterpretedFunction.run

        def run(self, *a, **k):
            launches.append(self.fn.__name__)
            _IN_LAUNCH[0] = True
            try:
                return real_run(self, *a, **k)
            finally:
                _IN_LAUNCH[0] = False

        triton.runtime.interpreter.InterpretedFunction.run = run
    real_next, real_keys = counter_rng.DeviceSeedStream.next, counter_rng.derived_keys_tensor
    on = counter_rng._seed_kernels_on

    def counted(fn):
        def wrapper(*a, **k):
            n0 = len(launches)
            with _Count() as c:
                out = fn(*a, **k)
            counts["ops"] += c.ops + (len(launches) - n0)
            counts["derivations"] += 1
            return out
        return wrapper

    counter_rng.DeviceSeedStream.next = counted(real_next)
    counter_rng.derived_keys_tensor = counted(real_keys)
    counter_rng._seed_kernels_on = lambda t: kernels
    qmod.set_device_seeds(True)
    try:
        import fp4train.linear.operands as operands

        operands.derived_keys_tensor = counter_rng.derived_keys_tensor
        torch.manual_seed(0)
        q = fp4train.convert(nn.Sequential(nn.Linear(128, 128)), recipe, backend="triton")[0]
        from fp4train.linear.graph_op import with_device_seeds

        x = torch.randn(128, 128, requires_grad=True)
        y, *_ = torch.ops.fp4train.quantized_linear(x, q.weight, q.bias, with_device_seeds(q._config), torch.float32, True, True, [])
        y.sum().backward()
    finally:
        counter_rng.DeviceSeedStream.next, counter_rng.derived_keys_tensor = real_next, real_keys
        operands.derived_keys_tensor = real_keys
        counter_rng._seed_kernels_on = on
        qmod.set_device_seeds(False)
        if kernels:
            triton.runtime.interpreter.InterpretedFunction.run = real_run
    return {"recipe": recipe, "path": "triton kernels" if kernels else "reference int64 ops", **counts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernel path runs in Triton's interpreter on the CPU)")
    rows = [seed_ops_per_call(r, k) for r in ("tib2d", "nvfp4") for k in (False, True)]
    for r in rows:
        print(f"{r['recipe']:>6} {r['path']:<20}: {r['ops']:4d} ops in {r['derivations']} derivations per layer call")
    if args.json:
        args.json.write_text(json.dumps({"results": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
