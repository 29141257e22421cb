"""Where the NVFP4 16x16-tile values kernel disagrees with the reference on a GPU (it failed there at
262876e while the codes kernel, same program, passed). Prints, for the test's (64, 160) tensor, the
mismatch count per tile, the first mismatches (input, got, reference, the tile's scale), and whether
the got values equal the reference's under simple relations (negated, scaled, shifted by one tile).

    python scripts/probes/nvfp4_tile_values.py
"""

import torch

import fp4train

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU: under TRITON_INTERPRET=1
from fp4train.kernels.nvfp4_tiles import nvfp4_tile_values, quantize_nvfp4_2d


def main():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 160, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    x[0, 5], x[17, 40] = float("nan"), float("-inf")
    x[:16, 16:32] = 0.0
    x[16:32, 48:64] *= 1e-30
    for label, xx in (("test tensor", x), ("plain randn", torch.randn(64, 160, generator=g))):
        ref = fp4train.quantize(xx, "nvfp4", block=(16, 16)).scaled_bf16()
        got = nvfp4_tile_values(xx.to(DEV))
        gv, rv = got.values.float().cpu(), ref.values.float()
        same = (gv == rv) | (gv.isnan() & rv.isnan())
        print(f"== {label}: divisor got {got.divisor.item()} ref {ref.divisor.item()}; mismatched {int((~same).sum())} / {same.numel()}")
        per_tile = (~same).reshape(4, 16, 10, 16).sum((1, 3))
        print("mismatches per tile:\n", per_tile)
        idx = (~same).nonzero()[:12]
        q = quantize_nvfp4_2d(xx.to(DEV))
        for r, c in idx.tolist():
            print(f"  ({r},{c}) x={xx[r, c].item():.4g} got={gv[r, c].item():.6g} ref={rv[r, c].item():.6g} "
                  f"tile scale code={int(q.scales[r // 16, c // 16])}")
        fin = ~same & rv.isfinite() & gv.isfinite() & (rv != 0)
        if fin.any():
            ratio = gv[fin] / rv[fin]
            print("  got/ref over finite mismatches: unique (first 10)", ratio.unique()[:10].tolist())
        print("  got == -ref where mismatched:", bool(((gv == -rv) | ~(~same)).all()))
        print("  got row 0, cols 0..40:", gv[0, :40].tolist())
        print("  ref row 0, cols 0..40:", rv[0, :40].tolist())


if __name__ == "__main__":
    main()
