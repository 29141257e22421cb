"""Probe (arithmetic, no GPU): how much of BF16's peak memory packing the quantized linears' inputs can remove.

Issue #5 asks for a peak 1.3x lower than BF16's at the same batch. This counts, from the model's shapes, the BF16
inputs that a quantized linear could stop saving (q/k/v's, gate/up's and down's; o's input is not counted: SDPA
keeps the same tensor for its own backward), what the same inputs cost packed as MXFP4 (4 bits an element plus an
8-bit scale per 32), and the BF16 copies of the linear weights that autocast makes for BF16's backward. With the
measured peaks of ``bench/results/summary.json`` it prints the bound: BF16's peak with those inputs at zero bytes.

    python scripts/probes/activation_budget.py [--model 1b] [--batch-size 8] [--seq-len 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fp4train import models

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MXFP4_BITS = 4 + 8 / 32  # E2M1 element + its share of the E8M0 block scale


def budget(model: str, tokens: int) -> dict:
    """GiB figures for ``model`` at ``tokens`` tokens a step (see the module docstring)."""
    with torch.device("meta"):
        m = models.build(model)
    c = m.config
    per_layer = tokens * (c.dim + c.dim + c.ffn_dim)  # inputs of q/k/v (one X), gate/up (one X) and down
    inputs = per_layer * c.n_layers * 2 / GIB  # BF16
    linear_weights = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    params = sum(p.numel() for p in m.parameters())
    return {"model": model, "tokens": tokens, "quantized_inputs_bf16_gib": inputs,
            "quantized_inputs_mxfp4_gib": inputs * MXFP4_BITS / 16, "bf16_weight_copies_gib": linear_weights * 2 / GIB,
            "fp32_weights_grads_adamw_gib": params * 16 / GIB}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    b = budget(args.model, args.batch_size * args.seq_len)
    e2e = json.loads((ROOT / "bench/results/summary.json").read_text())["e2e"].get(args.model, {})
    bf16, mx = e2e.get("bf16", {}).get("peak_mem_gib"), e2e.get("mxfp4", {}).get("peak_mem_gib")
    if bf16:
        floor = bf16 - b["quantized_inputs_bf16_gib"]
        b |= {"bf16_peak_gib": bf16, "floor_gib": floor, "floor_ratio": bf16 / floor,
              "mxfp4_predicted_gib": floor + b["quantized_inputs_mxfp4_gib"], "mxfp4_measured_gib": mx}
    for k, v in b.items():
        print(f"{k:>30}: {v:.2f}" if isinstance(v, float) else f"{k:>30}: {v}")
    if args.json:
        args.json.write_text(json.dumps(b, indent=1) + "\n")
    return b


if __name__ == "__main__":
    main()
