"""Probe: run a few quantize/fold kernel calls, each twice, for Nsight Compute to read their hardware counters.

Question: why do the fused fold and the MXFP4 row kernel run at 3-12x their memory floor (docs/LOG.md, session 20)?
Static counts say the issue time is not the limit (~1.2 warp instructions per element); `ncu` says where the warps
wait (memory latency, shared memory, barriers), the achieved occupancy and the DRAM throughput. This script only
makes the launches: the copy, the 1D MXFP4 kernel (even/odd and reshape packing) on quantize_speed's 16384 x 8192
BF16 tensor, and the fused Hadamard fold on the shapes of AdaHOP's 1b step (bench/results/fold_calls-...json) at
the launches in use. The first call of each compiles; ncu then profiles every launch (``scripts/gpu/ncu_fold.sh``).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --csv python scripts/probes/ncu_cases.py
"""

from __future__ import annotations

import argparse

import torch

from fp4train.kernels.mx_fold import quantize_mxfp4_fp8
from fp4train.kernels.mx_quantize import quantize_mxfp4

#: (name, shape, dtype, blocks along dim 0, group rows): fold calls of AdaHOP's 1b step with a fused 32-point transform
FOLD_CASES = [("X along K", (16384, 2048), torch.bfloat16, False, 1),
              ("X of o/down along K", (16384, 512), torch.bfloat16, False, 1),
              ("dY/X along M", (16384, 2048), torch.bfloat16, True, 1),
              ("W of k/v along N", (512, 2048), torch.float32, True, 128),
              ("W along K", (2048, 2048), torch.float32, False, 128)]


def fold_case_name(name: str, shape: tuple, dtype: torch.dtype) -> str:
    """A fold case's name as this script prints it (``ran NAME``) and ``ncu_table.py`` reads it back."""
    return f"fold {name} {list(shape)} {str(dtype).removeprefix('torch.')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated substrings of the case names to run (default: all)")
    ap.add_argument("--small", action="store_true", help="every shape divided by 32, at least 128 (a check of the cases under Triton's interpreter)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.small:
        raise SystemExit("ncu_cases needs a CUDA GPU (or --small under TRITON_INTERPRET=1)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    div = 32 if args.small else 1
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn(16384 // div, 8192 // div, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(big)
    cases = [("copy 16384x8192", lambda: out.copy_(big)),
             ("mxfp4 even/odd 16384x8192", lambda: quantize_mxfp4(big)),
             ("mxfp4 reshape packing 16384x8192", lambda: quantize_mxfp4(big, pairs=False)),
             ("mxfp4 even/odd SR 16384x8192", lambda: quantize_mxfp4(big, rounding="stochastic", seed=1))]
    for name, shape, dtype, along_0, gr in FOLD_CASES:
        x = torch.randn(*(max(128, n // div) for n in shape), device=dev, dtype=dtype, generator=g)
        cases.append((fold_case_name(name, shape, dtype),
                      lambda x=x, along_0=along_0, gr=gr: quantize_mxfp4_fp8(x, group_rows=gr, axis=0 if along_0 else 1,
                                                                             hadamard_block=32)))
    only = [s for s in args.only.split(",") if s]
    ran = []
    for name, fn in cases:
        if only and not any(s in name for s in only):
            continue
        for _ in range(1 if args.small else 2):  # the first compiles; ncu profiles both
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"ran {name}", flush=True)
        ran.append(name)
    return ran


if __name__ == "__main__":
    main()
