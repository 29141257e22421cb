"""The preset recipes of docs/methods.md, Recipes (AdaHOP and Full-Stack FP4 come with their own modules).

Operand names per GEMM (``C = A B^T``, blocks along the inner dim):
fprop ``a=X, b=W`` (inner K), dgrad ``a=dY, b=W^T`` (inner N), wgrad ``a=dY^T, b=X^T`` (inner M).
"""

from __future__ import annotations

import dataclasses

from .spec import DEFAULT_OVERRIDES, GemmSpec, LinearSpec, LoRASVDSpec, Override, QuantSpec, Recipe, TransformSpec


def _uniform(q: QuantSpec, grad: QuantSpec | None = None, transform: TransformSpec | None = None) -> LinearSpec:
    """Every weight/activation operand ``q``, every gradient operand ``grad`` (default ``q``)."""
    g = grad or q
    return LinearSpec(
        fprop=GemmSpec(a=q, b=q, transform=transform),
        dgrad=GemmSpec(a=g, b=q, transform=transform),
        wgrad=GemmSpec(a=g, b=q, transform=transform),
    )


BF16 = Recipe(
    name="bf16",
    description="No quantization: every GEMM in the compute dtype (the baseline).",
)

FP8_ROWWISE = Recipe(
    name="fp8_rowwise",
    linear=_uniform(QuantSpec("fp8")),
    description="FP8 E4M3, one FP32 scale per row along each GEMM's inner dim (the Hopper FP8 baseline).",
)

MXFP4 = Recipe(
    name="mxfp4",
    linear=_uniform(QuantSpec("mxfp4")),
    description="Naive MXFP4: 1x32 blocks along every GEMM's inner dim, floor (OCP) scales, round-to-nearest-even.",
)

_NV_W = QuantSpec("nvfp4", block=(16, 16))
_NV_X = QuantSpec("nvfp4")
_NV_G = QuantSpec("nvfp4", rounding="stochastic")
NVFP4 = Recipe(
    name="nvfp4",
    linear=LinearSpec(
        fprop=GemmSpec(a=_NV_X, b=_NV_W),
        dgrad=GemmSpec(a=_NV_G, b=_NV_W),
        wgrad=GemmSpec(a=_NV_G, b=_NV_X, transform=TransformSpec(block=16, random_signs=True)),
    ),
    keep_last_blocks=0.15,
    description=(
        "NVIDIA's NVFP4 recipe: 1x16 blocks, W in 16x16 tiles, RHT-16 on wgrad, "
        "stochastic rounding on gradients, last 15% of blocks in BF16."
    ),
)

HADAMARD_MXFP4 = Recipe(
    name="hadamard_mxfp4",
    linear=_uniform(
        QuantSpec("mxfp4"),
        grad=QuantSpec("mxfp4", rounding="stochastic"),
        transform=TransformSpec(block=32),
    ),
    description="Uniform Hadamard (HALO/Quartet style): block-32 inner Hadamard on every GEMM, MXFP4, SR on gradients.",
)

def _tib2d_linear(fmt: str) -> LinearSpec:
    """W and dY in 32x32 tiles (one quantization serves both of their GEMMs), X in 1x32."""
    w = QuantSpec(fmt, block=(32, 32), scale="ceil")
    x = QuantSpec(fmt, block=32, scale="ceil")
    g = QuantSpec(fmt, block=(32, 32), scale="ceil", rounding="stochastic")
    return LinearSpec(fprop=GemmSpec(a=x, b=w), dgrad=GemmSpec(a=g, b=w), wgrad=GemmSpec(a=g, b=x))


TIB2D = Recipe(
    name="tib2d",
    linear=_tib2d_linear("mxfp4"),
    overrides=(
        *DEFAULT_OVERRIDES,
        Override("role:query", _tib2d_linear("mxfp8")),
        Override("role:key", _tib2d_linear("mxfp8")),
    ),
    description=(
        "Transposition-invariant 2D blocks (arXiv 2607.24953): W and dY in 32x32 tiles, X in 1x32, "
        "ceil scales, SR on gradients, attention's Q and K projections (fused ones included) in MXFP8."
    ),
)

ADAHOP = Recipe(
    name="adahop",
    description=(
        "AdaHOP (arXiv 2604.02525): 20 BF16 calibration steps record W/X/dY outlier patterns, then per layer "
        "and GEMM inner Hadamard or outlier extraction (MXFP4), by the measured rule table."
    ),
    calibrate="rules",
    calibration_steps=20,
)

ADAHOP_PLAIN = dataclasses.replace(
    ADAHOP,
    name="adahop_plain",
    calibration_strategies=("plain", "iht", "oe"),
    description="AdaHOP with plain MXFP4 (no transform) as a third strategy where no outlier pattern is seen (ours).",
)

ADAHOP_MEASURED = Recipe(
    name="adahop_measured",
    description=("AdaHOP with per-layer, per-GEMM strategies (inner Hadamard or outlier extraction) picked by the lowest "
                 "output error on the calibration batches (ours)."),
    calibrate="measured",
    calibration_steps=20,
)

FULLSTACK = Recipe(
    name="fullstack",
    linear=NVFP4.linear,
    lora_svd=LoRASVDSpec(),
    attention="nvfp4",
    optimizer="qroot",
    four_over_six=True,
    description=(
        "Full-Stack FP4 (arXiv 2607.04422) as the paper trains it: NVFP4 LoRA-SVD linears with 4/6 block scaling (rank "
        "32, realigned every 4k steps, the factors at twice the learning rate), NVFP4 attention (Q/K/V and dS), Q-Root "
        "(native NVFP4 Newton-Schulz) on the hidden matrices and AdamW with NVFP4 moments on the rest; every block "
        "quantized. Its BF16 baseline trains with --optimizer root."
    ),
)

FULLSTACK_QADAMW = dataclasses.replace(
    FULLSTACK,
    name="fullstack_qadamw",
    optimizer="qadamw",
    description="Full-Stack FP4 with AdamW (NVFP4 moments) on every parameter instead of Q-Root on the hidden matrices.",
)

PRESETS = (BF16, FP8_ROWWISE, MXFP4, NVFP4, HADAMARD_MXFP4, TIB2D, ADAHOP, ADAHOP_PLAIN, ADAHOP_MEASURED, FULLSTACK, FULLSTACK_QADAMW)
