"""Every quantization the presets run gives its committed bits on fixed inputs, on any CPU (``golden_quantizers.py``
says why they are machine-independent and how they are rewritten)."""

import json

from golden_quantizers import GOLDEN, SEED, SHAPE, exact_input, hashes, operand_cases

REGENERATE = "if a quantizer's numerics changed on purpose, rewrite them (python tests/golden_quantizers.py) and commit them"


def test_every_quantizer_gives_its_golden_bits():
    golden = json.loads(GOLDEN.read_text())
    assert golden["shape"] == list(SHAPE) and golden["seed"] == SEED
    got = hashes()
    assert sorted(got) == sorted(golden["hashes"]), f"the presets' quantized operands changed: {REGENERATE}"
    changed = [k for k in got if got[k] != golden["hashes"][k]]
    assert not changed, f"{len(changed)} quantizers give other bits ({changed[:3]}): {REGENERATE}"


def test_the_golden_cases_cover_the_presets_formats_and_the_input_is_exact():
    kinds = {(q.format, q.is_2d, q.rounding, q.four_over_six, t is not None) for q, t in operand_cases().values()}
    assert {("mxfp4", True, "stochastic", False, False), ("nvfp4", False, "stochastic", True, True),
            ("fp8", False, "nearest", False, False), ("mxfp8", True, "nearest", False, False)} <= kinds
    x = exact_input()
    assert (x == 0).any() and x.abs().max() > 1000 * x.abs()[x != 0].median()  # zeros and outliers
    assert x.double().mul(2.0 ** 40).frac().eq(0).all()  # 20-bit mantissas times powers of two: exact in FP32
