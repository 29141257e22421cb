"""Full-Stack FP4's quantized attention against PyTorch's SDPA: speed, memory and error at model shapes.

Question: what does NVFP4 attention (fp4train.attention, Triton kernels on a GPU) cost against the attention
users run today (``F.scaled_dot_product_attention``, FlashAttention backend on Hopper), and how far are its
output and gradients from it? Forward + backward of one causal attention call, BF16 inputs, CUDA-event
medians, both in the same run; peak memory of the call above its inputs; SQNR of O, dQ, dK, dV against SDPA.

    python bench/attention_speed.py            # 1b (32 heads, 8 kv heads, d 64) and 3b (24/8, d 128), seq 2048 and 4096

Writes ``bench/results/attention_speed-<device>.json``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import results_path, sqnr_db, write_results
from fp4train.attention import nvfp4_attention
from fp4train.timing import median_time

SHAPES = {  # model: (heads, kv heads, head dim)
    "1b": (32, 8, 64),
    "3b": (24, 8, 128),
}


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def nvfp4(q, k, v):
    return nvfp4_attention(q, k, v, causal=True)


def run_one(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def measure(model: str, seq: int, tokens: int, repeats: int) -> dict:
    h, hkv, d = SHAPES[model]
    b = max(1, tokens // seq)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, seq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, seq, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn(b, h, seq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    row = {"model": model, "batch": b, "seq_len": seq, "heads": h, "kv_heads": hkv, "head_dim": d}
    ref = run_one(sdpa, q, k, v, do)
    got = run_one(nvfp4, q, k, v, do)
    row["sqnr_db"] = {n: sqnr_db(r.float(), x.float()) for n, x, r in zip(("O", "dQ", "dK", "dV"), got, ref)}
    base = torch.cuda.memory_allocated()
    for name, fn in (("sdpa", sdpa), ("nvfp4", nvfp4)):
        torch.cuda.reset_peak_memory_stats()
        run_one(fn, q, k, v, do)
        row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[f"{name}_ms"] = median_time(lambda fn=fn: run_one(fn, q, k, v, do), repeats) * 1e3
        row[f"{name}_fwd_ms"] = median_time(lambda fn=fn: fn(q, k, v), repeats) * 1e3
    row["nvfp4_vs_sdpa_time"] = row["nvfp4_ms"] / row["sdpa_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1b,3b")
    ap.add_argument("--seq-lens", default="2048,4096")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per call (batch = tokens / seq)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_speed measures GPU kernels; no CUDA GPU here")
    rows = []
    for m in args.models.split(","):
        for s in map(int, args.seq_lens.split(",")):
            r = measure(m, s, args.tokens, args.repeats)
            rows.append(r)
            print(f"{m} seq {s}: sdpa {r['sdpa_ms']:.2f} ms, nvfp4 {r['nvfp4_ms']:.2f} ms ({r['nvfp4_vs_sdpa_time']:.2f}x), "
                  f"peak {r['sdpa_peak_mib']:.0f} / {r['nvfp4_peak_mib']:.0f} MiB, SQNR "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["sqnr_db"].items()), flush=True)
            write_results(results_path("attention_speed"), rows, tokens=args.tokens, repeats=args.repeats, causal=True)


if __name__ == "__main__":
    main()
