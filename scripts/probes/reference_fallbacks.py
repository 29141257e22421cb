"""Probe: which operand preparations of a recipe fall back from the Triton kernels to the reference
quantization (``quantize_tensors``, compiled by Inductor on a GPU) in a training step?

On the H200 a tib2d step spent about 75 ms in Inductor-compiled reference quantization kernels
(``triton_poi_fused___lshift____to_copy_...frexp...``, 32 launches each: the q/k projections;
bench/results/profile_step/1b-H200-tib2d-f264ba3.json). This runs one step of a small model with the
``triton`` backend and numerics under Triton's CPU interpreter (the same dispatch as on a GPU) and
counts the reference calls (quantization, and decoding to BF16 values where no kernel covers it) by
format, block, axis and shape, with the calling line.

    python scripts/probes/reference_fallbacks.py --recipe tib2d [--device cuda] [--compile]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

if "--device" not in sys.argv or "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU: the kernels in Triton's interpreter

import torch

import fp4train
import fp4train.formats.quantize
from fp4train import models

fq = sys.modules["fp4train.formats.quantize"]


def _caller() -> str:
    """The innermost frame of the quantized linear or a backend that led here, as ``file:line function``."""
    here = next((f for f in reversed(traceback.extract_stack()[:-2])
                 if "fp4train/linear" in f.filename or "fp4train/backends" in f.filename), None)
    return f"{os.path.basename(here.filename)}:{here.lineno} {here.name}" if here else "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tib2d")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (the graph ops)")
    ap.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = fp4train.convert(models.build(args.model).to(dev), args.recipe, backend="triton")
    fp4train.formats.set_numerics("triton")
    calls = collections.Counter()
    real = fq.quantize_tensors

    def spy(x, keys, **kw):
        calls[(kw["fmt"], kw["block"], kw["axis"], tuple(x.shape), keys is not None, _caller())] += 1
        return real(x, keys, **kw)

    fq.quantize_tensors = spy
    import fp4train.linear.operands as ops
    ops.quantize_tensors = spy
    # QuantizedTensor -> BF16 values: on a GPU a kernel (decode_scaled_bf16) covers most (MXFP4/NVFP4/MXFP8);
    # anything else decodes through the reference (compiled by Inductor). The CPU takes the reference for all,
    # so a call counts only when the kernel would not cover it.
    from fp4train.formats.qtensor import QuantizedTensor
    from fp4train.kernels import decode_scaled_bf16
    real_split = QuantizedTensor.scaled_bf16

    def split_spy(self):
        if decode_scaled_bf16(self) is None:
            calls[("decode " + self.fmt, self.layout.block, self.layout.axis, tuple(self.shape), False, _caller())] += 1
        return real_split(self)

    QuantizedTensor.scaled_bf16 = split_spy
    tokens = torch.randint(0, 100, (2, 256), device=dev)
    run = torch.compile(model) if args.compile else model
    with torch.autocast(dev.type, dtype=torch.bfloat16):  # as the trainer runs on a GPU: BF16 activations
        loss = run(tokens, tokens)
    loss.backward()
    for (fmt, block, axis, shape, sr, where), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        print(f"{n:3d}x {fmt} block {block} axis {axis} shape {shape} {'SR' if sr else 'nearest'}  <- {where}")
    print(f"{sum(calls.values())} reference quantizations or decodes in one step")


if __name__ == "__main__":
    main()
