"""Bytes a training step keeps for backward, per recipe: what do the quantized linears save, and what the rest?

Question: the quantized linears save X packed (~4x smaller than BF16), yet on the H200 the FP4 recipes'
peak memory was above BF16's (docs/LOG.md, session 9) - where do the saved bytes go? Runs one forward
of a model under autocast (BF16) with ``torch.autograd.graph.saved_tensors_hooks`` counting every
distinct storage saved for backward (parameters excluded), eager and ``torch.compile``d (the hooks see
what the compiled graphs save through their autograd functions too), and splits the total by dtype
(uint8 = packed FP4 codes / E8M0 scales; bfloat16 / float32 = the rest). On a GPU it first runs
whole steps (forward with the loss, as bench/train_speed.py runs it, and backward; no hooks
installed) and reads the allocator: memory held after the forward (the saved tensors, as allocated)
and the peaks of forward and backward, each above the parameters (no optimizer) - which phase sets
the peak, and by how much. That step runs twice (compilation, allocator warm-up); the second is read.
Works on a CPU (small models) and on a GPU. Writes JSON (``--json``).

    python bench/saved_activations.py --model 20m --recipes bf16,mxfp4,tib2d --batch-size 2 --seq-len 256
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
from pathlib import Path

import torch

import fp4train
from fp4train import models
from fp4train.timing import code_commit

ROOT = Path(__file__).resolve().parent.parent


def saved_bytes(model_name: str, recipe: str, batch: int, seq: int, compile_: bool, device: str) -> dict:
    torch.manual_seed(0)
    model = models.build(model_name).to(device)
    rec = fp4train.recipes.get(recipe)
    strategies = None
    if rec.calibrate:  # AdaHOP: its BF16 calibration steps first, as the trainer and bench/train_speed.py run them
        from fp4train.adahop.calibration import calibrate_in_place

        cal_tokens = torch.randint(0, 1000, (batch, seq), device=device)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                model(cal_tokens, cal_tokens).backward()
            model.zero_grad(set_to_none=True)

        strategies = calibrate_in_place(model, rec, step, 3).strategy_counts()
    elif recipe != "bf16":
        fp4train.convert(model, recipe)
    if compile_:
        model = torch.compile(model)
    tokens = torch.randint(0, 1000, (batch, seq), device=device)
    cuda = device == "cuda"
    gib = 2.0**30
    mem = {}
    if cuda:  # the allocator, with no hooks installed (they may change what a compiled graph does)
        for _ in range(2):  # the first step compiles and warms the allocator; the second is read
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()  # parameters (and whatever else lives across steps)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(tokens, tokens)  # with the loss, as bench/train_speed.py runs it
            torch.cuda.synchronize()
            mem = {"params_gib": base / gib, "after_fwd_gib": (torch.cuda.memory_allocated() - base) / gib,
                   "fwd_peak_gib": (torch.cuda.max_memory_allocated() - base) / gib}
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            mem["bwd_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / gib
            del loss
        model.zero_grad(set_to_none=True)
    storages: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = (str(t.dtype).replace("torch.", ""), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(device, dtype=torch.bfloat16):
        model(tokens)
    by_dtype: dict = {}
    for dtype, n in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return {"recipe": recipe, "compile": compile_, **({"adahop_strategies": strategies} if strategies else {}),
            "saved_mib": sum(by_dtype.values()) / 2**20,
            "saved_mib_by_dtype": {k: v / 2**20 for k, v in sorted(by_dtype.items())}, "storages": len(storages), **mem}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m")
    ap.add_argument("--recipes", default="bf16,mxfp4,tib2d,nvfp4")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for compile_ in (False,) if args.no_compile else (False, True):
        for recipe in args.recipes.split(","):
            r = saved_bytes(args.model, recipe, args.batch_size, args.seq_len, compile_, device)
            torch._dynamo.reset()  # compiled graphs hold the last model: free it before the next (1b on an H200 ran out)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(r)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["saved_mib_by_dtype"].items())
            gpu = "".join(f", {k[:-4]} {r[k]:.2f} GiB" for k in ("after_fwd_gib", "fwd_peak_gib", "bwd_peak_gib") if k in r)
            print(f"{args.model} {'compiled' if compile_ else 'eager':>8} {recipe:>14}: saved {r['saved_mib']:7.1f} MiB ({parts}){gpu}",
                  flush=True)
            out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
                   "commit": code_commit() or "unknown", "torch": torch.__version__, "model": args.model,
                   "batch_size": args.batch_size, "seq_len": args.seq_len, "results": rows}
            if args.json:  # after every recipe: a run cut short keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
