"""Golden quantizer bits: every quantization the presets run, on fixed inputs, hashed (``test_golden_quantizers.py``).

Quantization is elementwise and blockwise arithmetic in a fixed order (block maxima, exact scale rules, rounding by
comparison, counter-based random numbers for stochastic rounding, fast Walsh-Hadamard transforms of additions): its
codes and scales are the same bits on every CPU, instruction set and PyTorch version. The inputs are made by integer
arithmetic (no random generator, no transcendental function), exact in FP32 everywhere. Run this file to rewrite
``golden_quantizers.json`` after a deliberate change of a quantizer's numerics, and commit it with the change:

    python tests/golden_quantizers.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden_quantizers.json")
SHAPE = (64, 256)
SEED = 1234  #: the stochastic-rounding and random-sign seed of every case


def exact_input(rows: int = SHAPE[0], cols: int = SHAPE[1], salt: int = 0) -> torch.Tensor:
    """A ``[rows, cols]`` FP32 tensor made by integer arithmetic: 20-bit mantissas times powers of two from 2**-12 to
    2**7 (rows of different magnitudes, some blocks with an outlier, some zeros), the same bits on every machine."""
    i = torch.arange(rows * cols, dtype=torch.int64) + salt * rows * cols
    h = (i * 2654435761 + 40503) % (1 << 31)
    h = (h * 2246822519 + 3266489917) % (1 << 31)
    mantissa = ((h % (1 << 20)).to(torch.float32) - (1 << 19)) / (1 << 19)  # in [-1, 1), exact
    exponent = (h >> 20) % 8 + (i // cols) % 12 - 12  # per element and row
    x = mantissa * ((exponent + 127) << 23).to(torch.int32).view(torch.float32)  # powers of two from their bits: exact
    x = torch.where(h % 97 == 0, x * 64, x)  # outliers
    x = torch.where(h % 89 == 0, torch.zeros_like(x), x)  # zeros
    return x.reshape(rows, cols)


def operand_cases() -> dict[str, tuple]:
    """``{name: (QuantSpec, TransformSpec or None)}``: every distinct quantized operand of the presets' linears (the
    4/6 variant of each NVFP4 one too), named by what it is."""
    import fp4train

    cases = {}
    for recipe in fp4train.recipes.PRESETS:  # the presets only: not a recipe another test registered
        linears = [recipe.linear] + [o.linear for o in recipe.overrides if o.linear is not None]
        for linear in linears:
            for gemm in (linear.fprop, linear.dgrad, linear.wgrad):
                for q in (gemm.a, gemm.b):
                    if not q.quantized:
                        continue
                    variants = [q]
                    if q.format == "nvfp4":
                        variants.append(fp4train.recipes.QuantSpec(q.format, q.block, q.scale, q.rounding, not q.four_over_six))
                    for v in variants:
                        t = gemm.transform
                        key = (f"{v.format} block={v.block} scale={v.scale} rounding={v.rounding} 4/6={v.four_over_six}"
                               + (f" hadamard={t.block}{' random signs' if t.random_signs else ''}" if t else ""))
                        cases[key] = (v, t)
    return dict(sorted(cases.items()))


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().contiguous().cpu()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hashes() -> dict[str, str]:
    """``{case: sha256}`` of each quantizer's codes, block scales and tensor scale on :func:`exact_input`: the linears'
    operands (both orientations of a 1D spec: along rows and along columns), NVFP4 attention's head quantization,
    and the NVFP4 optimizer states' encodings."""
    import fp4train
    from fp4train.attention.reference import quantize_heads
    from fp4train.formats.quantize import sr_keys
    from fp4train.optim import state_codec

    x = exact_input()
    out = {}
    for name, (q, t) in operand_cases().items():
        for axis in ((-1,) if q.is_2d else (-1, 0)):
            y = fp4train.hadamard(x, t.block, axis=axis, seed=SEED if t.random_signs else None) if t else x
            qt = fp4train.quantize(y, q.format, axis=axis, block=q.block, scale=q.scale, rounding=q.rounding,
                                   seed=SEED if q.rounding == "stochastic" else None, four_over_six=q.four_over_six)
            out[f"{name} axis={axis}"] = _digest(qt.codes, qt.scales, qt.tensor_scale)
    values, divisor = quantize_heads(x.reshape(2, 2, 16, 256)[..., :64])
    out["attention heads nvfp4"] = _digest(values, divisor)
    keys = sr_keys(SEED)
    m = state_codec.encode_signed(x)
    out["optimizer state signed nearest"] = _digest(*m.values())
    m = state_codec.encode_signed(x, keys=keys)
    out["optimizer state signed stochastic"] = _digest(*m.values())
    v = state_codec.encode_second_moment(x * x)
    out["optimizer state second moment"] = _digest(*v.values())
    return out


def main() -> None:
    GOLDEN.write_text(json.dumps({"shape": list(SHAPE), "seed": SEED, "hashes": hashes()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
