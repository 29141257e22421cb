"""Launch tuning of the operand kernels (the MXFP4 -> FP8 fold and its neighbours): which launch is fastest?

Question: how far does the fold kernel (the FP8 tensor-core operand; the largest cost of a 1b
training step on the H200, `docs/fast_path.md`) get from its current launch (16 rows per program,
4 warps) to the copy bandwidth, by launch parameters alone? Input a 16384 x 8192 BF16 tensor; for
blocks along dim 1 and along dim 0 (read in place as x^T), 1x128 and 128x128 groups, each
(rows per program, warps) pair is timed with CUDA events (median of ``--repeats``) against the copy
baseline of the same run; then the columns kernel (MXFP4 along dim 0, packed: X's wgrad operand) by
(columns per program, warps); then the 1D MX kernel (``mx1d``: packed MXFP4 / MXFP8 codes along the last
dim, the standalone quantization) by (blocks per program, warps); then tib2d's 32x32-tile kernel (stochastic rounding for dY, nearest for W;
the even/odd-column kernel and the general one, ``pairs``) by (tiles per program, warps) and its tile fold (either orientation)
by (rows per program, warps); ``hadamard`` (asked for by name) the fold with a fused 32-point Hadamard transform
(AdaHOP's IHT, hadamard_mxfp4) along either dim, its butterflies by permutes or by sums, by (rows per program, warps). The bits do not depend on
these parameters (tests/test_kernels.py).
Writes ``bench/results/fold_sweep-<gpu>.json``.

    python bench/fold_sweep.py [--rows 16384 --cols 8192 --repeats 10 --kernels fold,columns,mx1d,tiles,tile_fold,hadamard]
"""

from __future__ import annotations

import argparse
import datetime
import json
from functools import partial
from pathlib import Path

import torch

from fp4train.timing import code_commit, median_time

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kernels", default="fold,columns,mx1d,tiles,tile_fold", help="which sweeps to run (comma list; also: hadamard, the fold with a fused 32-point transform)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fold_sweep needs a CUDA GPU")
    from fp4train.kernels import quantize_mxfp4_fp8

    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    n = x.numel()
    moved = 2 * n + n + n // 32  # BF16 in, E4M3 out, scales (an upper bound for them)
    t_copy = median_time(lambda: y.copy_(x), args.repeats)
    copy_gbps = 4 * n / t_copy / 1e9
    counter = torch.zeros((), dtype=torch.int32, device="cuda")
    rows = []
    gpu = torch.cuda.get_device_name()
    path = args.json or ROOT / "bench/results" / f"fold_sweep-{gpu.replace(' ', '_')}.json"

    def save() -> dict:
        """Write every launch timed so far, and the fastest of each group; return that best."""
        best = {}
        for r in rows:
            if "ms" in r and (r["group"] not in best or r["ms"] < best[r["group"]]["ms"]):
                best[r["group"]] = r
        out = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": code_commit() or "unknown",
               "torch": torch.__version__, "shape": [args.rows, args.cols], "copy_GBps": copy_gbps, "results": rows, "best": best}
        path.write_text(json.dumps(out, indent=1) + "\n")
        return best

    def time_launch(group: str, moved_bytes: int, cfg: dict, fn) -> None:
        """Time ``fn`` (one launch configuration of the sweep ``group``), record it and print it; a launch
        that does not fit (registers, shared memory) is recorded with its error."""
        cfg = {"group": group, **cfg}
        label = " ".join(f"{k} {v}" for k, v in cfg.items())
        try:
            t = median_time(fn, args.repeats)
        except Exception as e:  # noqa: BLE001
            rows.append({**cfg, "error": repr(e)[:200]})
            print(f"{label}: {e!r}"[:200], flush=True)
            return
        gbps = moved_bytes / t / 1e9
        rows.append({**cfg, "ms": t * 1e3, "GBps": gbps, "fraction_of_copy": gbps / copy_gbps})
        print(f"{label}: {t * 1e3:7.3f} ms {gbps:7.1f} GB/s ({gbps / copy_gbps:.0%} of copy)", flush=True)
        save()  # after every launch: a run cut by its time limit keeps what it timed

    which = set(args.kernels.split(","))
    for axis in ((1, 0) if "fold" in which else ()):
        for gr in (1, 128):
            for rb in ((8, 16, 32, 64, 128) if gr == 1 else (128,)):
                for nw in (4, 8, 16, 32):
                    time_launch(f"fold axis {axis}, {gr}x128", moved, {"rows_per_program": rb, "num_warps": nw},
                                partial(quantize_mxfp4_fp8, x, axis=axis, group_rows=gr, rows_per_program=rb, num_warps=nw,
                                        counter=counter))
    # the fold with a fused 32-point Hadamard transform (AdaHOP's IHT, hadamard_mxfp4): FOLD_LAUNCH_HADAMARD
    # along either dim (an IHT layer folds X and W along dim 1 for fprop, dY along dim 1 and W along dim 0 for dgrad,
    # dY and X along dim 0 for wgrad), butterflies by permutes or sums
    for axis, gr, butterfly in ([(a, g, b) for a in (1, 0) for g in (1, 128) for b in ("permutes", "sums")] if "hadamard" in which else ()):
        for rb in ((8, 16, 32, 64) if gr == 1 else (128,)):
            for nw in ((4, 8, 16) if gr == 1 else (4, 8, 16, 32)):
                time_launch(f"hadamard 32 fold axis {axis}, {gr}x128, {butterfly}", moved, {"rows_per_program": rb, "num_warps": nw},
                            partial(quantize_mxfp4_fp8, x, axis=axis, group_rows=gr, hadamard_block=32, rows_per_program=rb,
                                    num_warps=nw, butterfly=butterfly, counter=counter))
    from fp4train.kernels.mx_quantize import quantize_mxfp4_columns

    moved_cols = 2 * n + n // 2 + n // 32  # BF16 in, packed E2M1 and E8M0 scales out
    for bk in ((32, 64, 128, 256) if "columns" in which else ()):
        for nw in (2, 4, 8):
            time_launch("columns (MXFP4 along dim 0, packed)", moved_cols, {"block_cols": bk, "num_warps": nw},
                        partial(quantize_mxfp4_columns, x, block_cols=bk, num_warps=nw))
    # the 1D MX kernel (packed codes + E8M0 scales along the last dim: quantize_mxfp4 / quantize_mxfp8, the standalone
    # quantization and quantize_speed's headline rows) by (blocks per program, warps)
    from fp4train.kernels import quantize_mxfp4, quantize_mxfp8

    # MXFP4 also by the even/odd-element kernel (pairs: the two codes of a byte side by side, no reshape to pack them)
    for fmt, rounding, pairs in ((("mxfp4", "nearest", False), ("mxfp4", "stochastic", False), ("mxfp8", "nearest", False),
                                  ("mxfp4", "nearest", True), ("mxfp4", "stochastic", True)) if "mx1d" in which else ()):
        fn, out_bytes = (partial(quantize_mxfp4, pairs=pairs), n // 2) if fmt == "mxfp4" else (quantize_mxfp8, n)
        for bp in (4, 16, 32, 64):
            for nw in (4, 8):
                time_launch(f"mx1d ({fmt}, {rounding}{', even/odd' if pairs else ''})", 2 * n + out_bytes + n // 32,
                            {"blocks_per_program": bp, "num_warps": nw},
                            partial(fn, x, rounding=rounding, seed=1, blocks_per_program=bp, num_warps=nw))
    # tib2d's kernels: 32x32 tiles (dY: ceil scale, stochastic rounding), then their folds as either operand
    from fp4train.kernels import quantize_mxfp4_2d
    from fp4train.kernels.mx_fold import fold_tiles_mxfp4

    moved_tiles = 2 * n + n // 2 + n // 1024
    for rounding in (("stochastic", "nearest") if "tiles" in which else ()):  # tib2d's dY, and its W
        for pairs in (True, False):  # the even/odd-column kernel, and the general one
            for tc in (2, 4, 8):
                for nw in (2, 4, 8):
                    time_launch(f"tiles (MXFP4 32x32, {rounding}, pairs {pairs})", moved_tiles,
                                {"tiles_per_program": tc, "num_warps": nw},
                                partial(quantize_mxfp4_2d, x, scale="ceil", rounding=rounding, seed=1, tiles_per_program=tc,
                                        num_warps=nw, pairs=pairs))
    q = quantize_mxfp4_2d(x, scale="ceil", rounding="stochastic", seed=1)
    moved_tile_fold = n // 2 + n // 1024 + n + n // 32
    for transposed, gr, per_row in (((False, 1, False), (False, 128, False), (True, 128, True)) if "tile_fold" in which else ()):
        for rb in ((4, 8, 16, 32, 64, 128) if gr == 1 else (128,)):
            for nw in (2, 4, 8, 16, 32):
                time_launch(f"tile fold transposed {transposed}, {gr}x128", moved_tile_fold, {"rows_per_program": rb, "num_warps": nw},
                            partial(fold_tiles_mxfp4, q.codes, q.scales, transposed=transposed, group_rows=gr, scale_per_row=per_row,
                                    rows_per_program=rb, num_warps=nw, counter=counter))
    for k, r in save().items():
        launch = ", ".join(f"{name} {r[name]}" for name in r if name not in ("group", "ms", "GBps", "fraction_of_copy"))
        print(f"best {k}: {launch}: {r['ms']:.3f} ms, {r['fraction_of_copy']:.0%} of copy")


if __name__ == "__main__":
    main()
