"""A mixture of experts' expert GEMMs, forward + backward, per recipe against BF16 - looped and grouped.

Question: what do quantized experts cost against BF16 experts? fp4train's expert path
(:func:`fp4train.linear.experts.experts_forward`) runs each projection as grouped GEMMs over all experts
(operands prepared per expert, one ``torch._grouped_mm`` per GEMM); it is timed against BF16's grouped GEMM
(``torch._grouped_mm`` on the BF16 weights) and BF16's loop over experts (transformers' own), and against
fp4train's own loop (one quantized linear call pair per expert, what outlier-extraction recipes run).
One MoE block of a model preset (router, top-k, SwiGLU experts; default ``moe-1b``: 8 experts of 2048 -> 1024,
two per token), ``--tokens`` tokens in BF16 autocast, the block's output backpropagated; the router's choices are
the same for every variant (one seed). Timed per forward + backward with a synchronisation after each (both
paths read the experts' token counts on the host, so this is the time a training step sees), median of ``--repeats``;
and the GPU's kernel time of one of them (``torch.profiler``), which does not depend on the host: where the wall
time is well above it, the path is bound by its host-side launches.

    python bench/experts_speed.py [--model moe-1b] [--tokens 16384] [--recipes nvfp4,tib2d,mxfp4]

Writes ``bench/results/experts_speed-<model>-<gpu>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fp4train
from common import kernel_times, results_path, write_results
from fp4train.models import PRESETS
from fp4train.models.moe import MoE
from fp4train.timing import median_time


def grouped_experts(module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """BF16 experts as two grouped GEMMs (``torch._grouped_mm``): tokens sorted by expert, every expert at once."""
    flat = index.flatten()
    order = flat.argsort(stable=True)
    tok = order // index.shape[1]
    offsets = torch.bincount(flat, minlength=module.num_experts).cumsum(0).to(torch.int32)
    x = hidden[tok].to(torch.bfloat16)
    h = torch._grouped_mm(x, module.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs=offsets)
    h = module._apply_gate(h)
    y = torch._grouped_mm(h, module.down_proj.to(torch.bfloat16).transpose(1, 2), offs=offsets)
    y = y * weights.flatten()[order, None]
    return torch.zeros_like(hidden).index_add_(0, tok, y.to(hidden.dtype))


def _block(model: str, device: str) -> MoE:
    c = PRESETS[model]
    if not c.n_experts:
        raise SystemExit(f"experts_speed: {model} is not a mixture of experts; pick one of "
                         f"{[n for n, p in PRESETS.items() if p.n_experts]}")
    torch.manual_seed(0)
    block = MoE(c.dim, c.ffn_dim, c.n_experts, c.experts_per_token).to(device)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


def gpu_kernels(step) -> tuple[float, int]:
    """Milliseconds of GPU kernels, and how many were launched, in one call of ``step`` (``torch.profiler``): what the
    work costs the GPU apart from the host's time to launch it - a host-bound path's wall time follows the CPU, this
    does not."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_kernel = kernel_times(prof, 1).values()
    return sum(ms for ms, _ in per_kernel), sum(calls for _, calls in per_kernel)


def measure(block: MoE, x: torch.Tensor, repeats: int, grouped: bool = False) -> dict:
    """The block's forward + backward (with ``grouped``: the BF16 grouped GEMMs for its experts): ``ms`` (median wall
    time), ``gpu_ms`` and ``gpu_kernels`` (kernel time and launches of one of them; None off a GPU)."""
    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            if grouped:
                weights, index, _ = block.route(x)
                y = grouped_experts(block.experts, x, index, weights)
            else:
                y = block(x)
        y.float().square().mean().backward()
        x.grad = None
        for p in block.parameters():
            p.grad = None

    ms = median_time(step, repeats, back_to_back=False) * 1e3
    gpu_ms, kernels = gpu_kernels(step) if x.is_cuda else (None, None)
    return {"ms": ms, "gpu_ms": gpu_ms, "gpu_kernels": kernels}


def _prefixed(prefix: str, m: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in m.items()}


def _said(m: dict) -> str:
    gpu = "" if m["gpu_ms"] is None else f" (GPU kernels {m['gpu_ms']:.2f} ms, {m['gpu_kernels']} launches)"
    return f"{m['ms']:.2f} ms{gpu}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="moe-1b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--recipes", default="nvfp4,tib2d,mxfp4")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("experts_speed needs a CUDA GPU (or --device cpu for a smoke run)")
    for r in args.recipes.split(","):
        fp4train.recipes.get(r)  # an unknown recipe fails here, before any timing
    if args.model not in PRESETS:
        raise SystemExit(f"experts_speed: unknown model {args.model!r}")
    c = PRESETS[args.model]
    block = _block(args.model, args.device)
    x = torch.randn(args.tokens, c.dim, device=args.device, requires_grad=True)
    bf16 = measure(block, x, args.repeats)
    grouped = measure(block, x, args.repeats, grouped=True)
    rows = [{"recipe": "bf16", **bf16, **_prefixed("grouped", grouped)}]
    print(f"bf16: looped {_said(bf16)}, grouped {_said(grouped)}", flush=True)
    settings = dict(model=args.model, tokens=args.tokens, experts=c.n_experts, experts_per_token=c.experts_per_token,
                    dim=c.dim, ffn_dim=c.ffn_dim, repeats=args.repeats)
    path = args.json or results_path("experts_speed", args.model)
    for recipe in args.recipes.split(","):
        q = fp4train.convert(_block(args.model, args.device), recipe)
        m = measure(q, x, args.repeats)
        experts = q.experts.fp4train_experts
        row = {"recipe": recipe, **m, "vs_bf16_looped": bf16["ms"] / m["ms"], "vs_bf16_grouped": grouped["ms"] / m["ms"],
               "path": "grouped" if experts.grouped is not None else "looped"}
        if experts.grouped is not None:
            experts.grouped = None  # fp4train's loop over experts, for comparison
            looped = measure(q, x, args.repeats)
            row.update(_prefixed("looped", looped))
        rows.append(row)
        print(f"{recipe}: {_said(m)}, {row['path']} ({row['vs_bf16_looped']:.2f}x bf16 looped, "
              f"{row['vs_bf16_grouped']:.2f}x bf16 grouped)" + (f"; its loop over experts {_said(looped)}"
                                                                 if "looped_ms" in row else ""), flush=True)
        write_results(path, rows, **settings)
    write_results(path, rows, **settings)  # BF16's row too when no recipe is asked for


if __name__ == "__main__":
    main()
