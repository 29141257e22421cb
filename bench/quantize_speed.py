"""Quantization throughput: GB/s of the reference and the Triton kernel against the GPU's copy bandwidth.

Question: how close to memory bandwidth does one quantization pass run? Input a 16384 x 8192
BF16 tensor (256 MiB); bytes moved = input read + output written (packed codes and scales;
BF16 values for the fake-quantization kernels; E4M3 codes and group scales for the FP8 fold). Timed
with CUDA events, median of ``--repeats`` after warm-up; the copy baseline (``y.copy_(x)``,
read + write) is measured in the same run. Writes ``bench/results/quantize_speed-<gpu>.json``.

    python bench/quantize_speed.py [--rows 16384 --cols 8192 --repeats 20]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fp4train
from common import results_path, write_results
from fp4train.timing import median_time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("quantize_speed needs a CUDA GPU")
    from fp4train.kernels.mx_fold import quantize_mxfp4_fp8_and_columns
    from fp4train.kernels.mx_quantize import quantize_mxfp4_columns, quantize_mxfp8_columns
    from fp4train.kernels.nvfp4_quantize import quantize_nvfp4_columns
    from fp4train.kernels import (block_hadamard, fp8_rowwise_values, mxfp4_values, mxfp8_values, nvfp4_values,
                                  quantize_mxfp4, quantize_mxfp4_2d, quantize_mxfp4_dual, quantize_mxfp4_fp8, quantize_mxfp8,
                                  quantize_mxfp8_2d, quantize_nvfp4)

    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    n = x.numel()
    moved = {"copy": 2 * 2 * n, "mxfp4": 2 * n + n // 2 + n // 32, "nvfp4": 2 * n + n // 2 + n // 16,
             "mxfp4 both layouts": 2 * n + 2 * (n // 2 + n // 32), "mxfp8": 2 * n + n + n // 32,
             "mxfp4 tiles": 2 * n + n // 2 + n // 1024, "mxfp8 tiles": 2 * n + n + n // 1024,  # one scale per 32x32 tile
             "values": 2 * n + 2 * n, "fold": 2 * n + n + n // 32,
             "fold + columns": 2 * n + n + n // 32 + n // 2 + n // 32}
    results = {}
    t = median_time(lambda: y.copy_(x), args.repeats)
    results["copy"] = {"ms": t * 1e3, "GBps": moved["copy"] / t / 1e9}
    for name, (kind, fn) in {
        "reference mxfp4 nearest": ("mxfp4", lambda: fp4train.quantize(x, "mxfp4")),
        "triton mxfp4 nearest": ("mxfp4", lambda: quantize_mxfp4(x)),
        "triton mxfp4 stochastic": ("mxfp4", lambda: quantize_mxfp4(x, rounding="stochastic", seed=1)),
        # the default above is the even/odd-element kernel; the kernel that packs codes by a reshape, the same bits
        "triton mxfp4 nearest (reshape packing)": ("mxfp4", lambda: quantize_mxfp4(x, pairs=False)),
        "triton mxfp4 stochastic (reshape packing)": ("mxfp4", lambda: quantize_mxfp4(x, rounding="stochastic", seed=1, pairs=False)),
        "triton mxfp4 ceil": ("mxfp4", lambda: quantize_mxfp4(x, scale="ceil")),
        "triton mxfp4 both layouts (one read)": ("mxfp4 both layouts", lambda: quantize_mxfp4_dual(x)),
        "triton nvfp4 nearest (+amax)": ("nvfp4", lambda: quantize_nvfp4(x)),
        "triton mxfp4 along dim 0": ("mxfp4", lambda: quantize_mxfp4_columns(x)),
        "triton nvfp4 along dim 0 (+amax)": ("nvfp4", lambda: quantize_nvfp4_columns(x)),
        "triton mxfp8 nearest": ("mxfp8", lambda: quantize_mxfp8(x)),
        "triton mxfp8 stochastic": ("mxfp8", lambda: quantize_mxfp8(x, rounding="stochastic", seed=1)),
        "triton mxfp8 32x32": ("mxfp8 tiles", lambda: quantize_mxfp8_2d(x)),
        "triton mxfp8 along dim 0": ("mxfp8", lambda: quantize_mxfp8_columns(x)),
        "triton mxfp4 32x32 stochastic": ("mxfp4 tiles", lambda: quantize_mxfp4_2d(x, scale="ceil", rounding="stochastic", seed=1)),
        # fake quantization straight to BF16 values (what --numerics triton feeds the BF16 GEMM)
        "triton mxfp4 values axis 1": ("values", lambda: mxfp4_values(x, axis=1)),
        "triton mxfp4 values axis 0": ("values", lambda: mxfp4_values(x, axis=0)),
        "triton mxfp4 values 32x32": ("values", lambda: mxfp4_values(x, axis=None)),
        "triton mxfp8 values axis 1": ("values", lambda: mxfp8_values(x, axis=1)),
        "triton nvfp4 values axis 1 (+amax)": ("values", lambda: nvfp4_values(x, axis=1)),
        "triton fp8 rowwise values (+amax)": ("values", lambda: fp8_rowwise_values(x, axis=1)),
        "triton hadamard 32": ("values", lambda: block_hadamard(x, None, block=32, axis=1)),
        # MXFP4 folded into FP8 + 1x128 group scales (the FP8 tensor-core GEMM operand)
        "triton mxfp4 -> fp8 1x128": ("fold", lambda: quantize_mxfp4_fp8(x, group_rows=1)),
        "triton mxfp4 -> fp8 128x128": ("fold", lambda: quantize_mxfp4_fp8(x, group_rows=128)),
        # blocks along dim 0 (W along N, dY along M): x read in place as x^T
        "triton mxfp4 along dim 0 -> fp8 1x128": ("fold", lambda: quantize_mxfp4_fp8(x, axis=0, group_rows=1)),
        "triton mxfp4 along dim 0 -> fp8 128x128": ("fold", lambda: quantize_mxfp4_fp8(x, axis=0, group_rows=128)),
        "triton hadamard 32 + mxfp4 -> fp8 1x128 (fused)": ("fold", lambda: quantize_mxfp4_fp8(x, group_rows=1, hadamard_block=32)),
        # the layer's X: fprop's folded operand and wgrad's packed X from one read
        "triton X -> fp8 1x128 + mxfp4 along M": ("fold + columns", lambda: quantize_mxfp4_fp8_and_columns(x)),
    }.items():
        t = median_time(fn, args.repeats)
        gbps = moved[kind] / t / 1e9
        results[name] = {"ms": t * 1e3, "GBps": gbps, "fraction_of_copy": gbps / results["copy"]["GBps"]}
    for k, v in results.items():
        frac = f" ({v['fraction_of_copy']:.0%} of copy)" if "fraction_of_copy" in v else ""
        print(f"{k:>36}: {v['ms']:8.3f} ms  {v['GBps']:8.1f} GB/s{frac}")
    write_results(args.json or results_path("quantize_speed"), results, shape=[args.rows, args.cols], dtype="bfloat16")


if __name__ == "__main__":
    main()
