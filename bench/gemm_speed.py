"""GEMM throughput: MXFP4 on FP8 tensor cores (folded group scales) against cuBLAS BF16 and FP8 rowwise.

Question: how fast is an MXFP4 GEMM on Hopper when its operands are folded into FP8 with 1x128
(activation) / 128x128 (weight) group scales (docs/methods.md, Hopper execution), against BF16 and FP8
rowwise in the same run? ``C[M,N] = A[M,K] @ W[N,K]^T`` at 8192^3 and at the linear shapes of
Llama-3.2-1B and Llama-3-8B with 16k tokens. TFLOP/s = 2MNK / time; CUDA events, median of
``--repeats`` after warm-up. GEMM alone (operands prepared beforehand) and, for MXFP4, with both
operands quantized in the same timed region. The inexact-element count of the fold is reported.

    python bench/gemm_speed.py [--repeats 20] [--tokens 16384]

Writes ``bench/results/gemm_speed-<gpu>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import results_path, write_results
from fp4train.timing import median_time
from fp4train.backends.fp8_blockwise import blockwise_fp8_mm
from fp4train.formats.fold import FoldedFP8


# (name, N, K) of the linear layers; M = tokens
MODELS = {
    "llama-3.2-1b": [("qkv", 2048 + 2 * 512, 2048), ("o", 2048, 2048), ("gate_up", 2 * 8192, 2048), ("down", 2048, 8192)],
    "llama-3-8b": [("qkv", 4096 + 2 * 1024, 4096), ("o", 4096, 4096), ("gate_up", 2 * 14336, 4096), ("down", 4096, 14336)],
}


def fp8_blockwise_mm(a8, sa, w8, sw):
    """``a8 @ w8.T`` with 1x128 scales ``sa`` [M, K/128] and 128x128 scales ``sw`` [N/128, K/128] (BF16 out)."""
    return blockwise_fp8_mm(FoldedFP8(a8.view(torch.uint8), sa, 1, 0), FoldedFP8(w8.view(torch.uint8), sw, 128, 0), torch.bfloat16)


def fp8_rowwise_mm(a8, sa, w8, sw):
    return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16)


def measure(M: int, N: int, K: int, repeats: int) -> dict:
    from fp4train.kernels import quantize_mxfp4_fp8

    dev = "cuda"
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    flop = 2 * M * N * K
    res = {"M": M, "N": N, "K": K}
    res["bf16"] = flop / median_time(lambda: a @ w.t(), repeats) / 1e12
    # FP8 rowwise (the torchao-style Hopper baseline): E4M3 with one scale per row
    sa = a.float().abs().amax(1, keepdim=True) / 448
    sw = w.float().abs().amax(1, keepdim=True) / 448
    a8r, w8r = (a.float() / sa).to(torch.float8_e4m3fn), (w.float() / sw).to(torch.float8_e4m3fn)
    res["fp8_rowwise"] = flop / median_time(lambda: fp8_rowwise_mm(a8r, sa, w8r, sw), repeats) / 1e12
    # MXFP4 folded into FP8 with group scales
    counter = torch.zeros((), dtype=torch.int32, device=dev)
    fa = quantize_mxfp4_fp8(a, group_rows=1, counter=counter)
    fw = quantize_mxfp4_fp8(w, group_rows=128, counter=counter)
    a8, w8 = fa.codes.view(torch.float8_e4m3fn), fw.codes.view(torch.float8_e4m3fn)
    res["mxfp4_fp8_blockwise"] = flop / median_time(lambda: fp8_blockwise_mm(a8, fa.scales, w8, fw.scales), repeats) / 1e12

    def quantized():
        qa = quantize_mxfp4_fp8(a, group_rows=1, counter=counter)
        qw = quantize_mxfp4_fp8(w, group_rows=128, counter=counter)
        return fp8_blockwise_mm(qa.codes.view(torch.float8_e4m3fn), qa.scales, qw.codes.view(torch.float8_e4m3fn), qw.scales)

    res["mxfp4_fp8_blockwise_with_quantize"] = flop / median_time(quantized, repeats) / 1e12
    # correctness: the folded GEMM against a float64 product of the same MXFP4 values
    import fp4train

    ref = (fp4train.quantize(a, "mxfp4").dequantize(torch.float64) @ fp4train.quantize(w, "mxfp4").dequantize(torch.float64).t())
    out = fp8_blockwise_mm(a8, fa.scales, w8, fw.scales).double()
    res["rel_err_vs_fp64"] = float((out - ref).norm() / ref.norm())
    res["inexact_elements_first_fold"] = int(quantize_mxfp4_fp8(a, group_rows=1).inexact) + int(quantize_mxfp4_fp8(w, group_rows=128).inexact)
    res["speedup_vs_bf16"] = res["mxfp4_fp8_blockwise"] / res["bf16"]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemm_speed needs a CUDA GPU (FP8 tensor cores)")
    shapes = [("square", "8192^3", 8192, 8192, 8192)]
    shapes += [(m, n, args.tokens, N, K) for m, layers in MODELS.items() for n, N, K in layers]
    rows = []
    for model, name, M, N, K in shapes:
        r = {"model": model, "layer": name, **measure(M, N, K, args.repeats)}
        rows.append(r)
        print(f"{model:>13} {name:>8} {M}x{N}x{K}: bf16 {r['bf16']:7.1f}  fp8 rowwise {r['fp8_rowwise']:7.1f}  "
              f"mxfp4->fp8 blockwise {r['mxfp4_fp8_blockwise']:7.1f} ({r['speedup_vs_bf16']:.2f}x bf16; "
              f"with quantize {r['mxfp4_fp8_blockwise_with_quantize']:7.1f}) TFLOP/s, rel err {r['rel_err_vs_fp64']:.2e}, "
              f"inexact {r['inexact_elements_first_fold']}", flush=True)
    write_results(args.json or results_path("gemm_speed"), rows, unit="TFLOP/s")


if __name__ == "__main__":
    main()
