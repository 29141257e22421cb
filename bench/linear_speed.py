"""Quantized linear forward + backward time against BF16 ``nn.Linear``, at Llama linear shapes.

Question: how much faster (or slower) is one quantized linear layer - three GEMMs plus every
operand's quantization - than BF16, per recipe, numerics mode and backend? ``Y = X W^T`` with X
``[tokens, K]`` (BF16, requires grad) and a BF16-autocast forward, then ``Y.backward(dY)``;
CUDA events, median of ``--repeats`` after warm-up; BF16 ``nn.Linear`` measured in the same
run. Also the bytes each layer saves for backward (saved-tensor hooks).

    python bench/linear_speed.py [--tokens 16384] [--variants mxfp4:triton:emulated,mxfp4:triton:fp8_blockwise,...]

Writes ``bench/results/linear_speed-<gpu>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn

import fp4train
from common import results_path, write_results
from fp4train.timing import median_time

SHAPES = {  # (N, K) per layer
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
DEFAULT_VARIANTS = ("mxfp4:triton:emulated,mxfp4:triton:triton,hadamard_mxfp4:triton:triton,tib2d:triton:triton,"
                    "nvfp4:triton:triton,fp8_rowwise:triton:triton")


def _saved_bytes(layer, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x)
    return total


def measure(layer, x, dy, repeats):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)
        x.grad = None
        layer.weight.grad = None

    return median_time(step, repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="recipe:numerics:backend, comma-separated")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linear_speed needs a CUDA GPU")
    rows = []
    for model, layers in SHAPES.items():
        for name, (N, K) in layers.items():
            torch.manual_seed(0)
            lin = nn.Linear(K, N, bias=False, device="cuda")
            x = torch.randn(args.tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(args.tokens, N, device="cuda", dtype=torch.bfloat16)
            t_bf16 = measure(lin, x, dy, args.repeats)
            row = {"model": model, "layer": name, "tokens": args.tokens, "N": N, "K": K, "bf16_ms": t_bf16 * 1e3,
                   "bf16_saved_bytes": _saved_bytes(lin, x), "variants": {}}
            for v in args.variants.split(","):
                recipe, numerics, backend = v.split(":")
                layer = fp4train.QuantizedLinear.from_linear(lin, fp4train.recipes.get(recipe).linear, backend=backend, numerics=numerics)
                t = measure(layer, x, dy, args.repeats)
                row["variants"][v] = {"ms": t * 1e3, "speedup_vs_bf16": t_bf16 / t, "saved_bytes": _saved_bytes(layer, x)}
            rows.append(row)
            print(f"{model:>13} {name:>8} [{args.tokens}x{K}]x[{N}x{K}]^T: bf16 {t_bf16 * 1e3:7.2f} ms | "
                  + " | ".join(f"{k} {r['ms']:.2f} ms ({r['speedup_vs_bf16']:.2f}x)" for k, r in row["variants"].items()), flush=True)
            write_results(args.json or results_path("linear_speed"), rows)  # after every shape: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
