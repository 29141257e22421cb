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


def kernel_ms(step) -> float:
    """Milliseconds of GPU kernels in one call of ``step`` (``torch.profiler``): what the work costs the GPU, apart
    from the host's time to launch it - a host-bound path's wall time follows the CPU, this does not."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(ms for ms, _ in kernel_times(prof, 1).values())


def measure(block: MoE, x: torch.Tensor, repeats: int, grouped: bool = False) -> tuple[float, float | None]:
    """Median seconds of the block's forward + backward (with ``grouped``: the BF16 grouped GEMMs for its experts),
    and the milliseconds of GPU kernels in one of them (None off a GPU)."""
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

    t = median_time(step, repeats, back_to_back=False)
    return t, kernel_ms(step) if x.is_cuda else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


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
    bf16, bf16_gpu = measure(block, x, args.repeats)
    grouped, grouped_gpu = measure(block, x, args.repeats, grouped=True)
    row = {"recipe": "bf16", "ms": bf16 * 1e3, "grouped_ms": grouped * 1e3, "gpu_ms": bf16_gpu, "grouped_gpu_ms": grouped_gpu}
    rows = [row]
    print(f"bf16: looped {bf16 * 1e3:.2f} ms, grouped {grouped * 1e3:.2f} ms (GPU kernels {_ms(bf16_gpu)}, {_ms(grouped_gpu)})",
          flush=True)
    settings = dict(model=args.model, tokens=args.tokens, experts=c.n_experts, experts_per_token=c.experts_per_token,
                    dim=c.dim, ffn_dim=c.ffn_dim, repeats=args.repeats)
    for recipe in args.recipes.split(","):
        q = fp4train.convert(_block(args.model, args.device), recipe)
        t, gpu = measure(q, x, args.repeats)
        experts = q.experts.fp4train_experts
        row = {"recipe": recipe, "ms": t * 1e3, "vs_bf16_looped": bf16 / t, "vs_bf16_grouped": grouped / t,
               "path": "grouped" if experts.grouped is not None else "looped", "gpu_ms": gpu}
        if experts.grouped is not None:
            experts.grouped = None  # fp4train's loop over experts, for comparison
            looped, looped_gpu = measure(q, x, args.repeats)
            row.update(looped_ms=looped * 1e3, looped_gpu_ms=looped_gpu)
        rows.append(row)
        print(f"{recipe}: {t * 1e3:.2f} ms (GPU kernels {_ms(gpu)}), {row['path']} ({bf16 / t:.2f}x bf16 looped, "
              f"{grouped / t:.2f}x bf16 grouped)"
              + (f"; its loop over experts {row['looped_ms']:.2f} ms" if "looped_ms" in row else ""), flush=True)
        write_results(args.json or results_path("experts_speed", args.model), rows, **settings)
    write_results(args.json or results_path("experts_speed", args.model), rows, **settings)


if __name__ == "__main__":
    main()
