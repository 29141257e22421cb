"""SQNR (dB) of a quantized linear layer's output and both gradients, per recipe.

Question: how close are Y, dX and dW of each recipe to an exact (float64) ``nn.Linear``?
Runs on the CPU (reference numerics, emulated backend). Writes
``bench/results/sqnr_linear.json``.

    python bench/sqnr_linear.py [--tokens 512 --in 256 --out 384 --seeds 0 1]

Input X: N(0, 1) with every 37th input channel scaled by 8 (a few outlier channels);
dY: N(0, 1); W, b: ``nn.Linear``'s default init. The recipe's ``keep_last_blocks`` is off.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn

import fp4train
from common import results_path, sqnr_db, write_results


def measure(recipe: str, tokens: int, k: int, n: int, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    x = torch.randn(tokens, k)
    x[:, ::37] *= 8
    dy = torch.randn(tokens, n)
    ref = nn.Linear(k, n).double()
    ref.load_state_dict(lin.state_dict())
    model = fp4train.convert(nn.Sequential(lin), fp4train.recipes.get(recipe).replace(keep_last_blocks=0.0))
    xq, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    model(xq).backward(dy)
    yq = model(x).detach()
    yr = ref(xr)
    yr.backward(dy.double())
    return {
        "Y": round(sqnr_db(yr, yq), 2),
        "dX": round(sqnr_db(xr.grad, xq.grad), 2),
        "dW": round(sqnr_db(ref.weight.grad, lin.weight.grad), 2),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--in", dest="k", type=int, default=256)
    ap.add_argument("--out", dest="n", type=int, default=384)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json", type=Path, default=results_path("sqnr_linear", per_device=False))
    args = ap.parse_args(argv)
    rows = []
    print("| recipe | seed | Y | dX | dW |\n|---|---:|---:|---:|---:|")
    for name in fp4train.recipes.names():
        if name == "bf16" or fp4train.recipes.get(name).calibrate:
            continue  # AdaHOP recipes are made per layer by calibration (see bench/adahop_pattern_pairs.py)
        for seed in args.seeds:
            r = {"recipe": name, "seed": seed, **measure(name, args.tokens, args.k, args.n, seed)}
            rows.append(r)
            print(f"| {name} | {seed} | {r['Y']:.2f} | {r['dX']:.2f} | {r['dW']:.2f} |")
    write_results(args.json, rows, tokens=args.tokens, in_features=args.k, out_features=args.n)


if __name__ == "__main__":
    main()
