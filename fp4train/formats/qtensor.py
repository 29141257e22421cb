"""QuantizedTensor: codes + scales + everything needed to give the values back.

A plain container (not a ``torch.Tensor`` subclass): it is what the quantized linear saves
for backward and what a GEMM backend consumes. Its tensors are laid out *canonically* (see
:mod:`fp4train.formats.layout`): the block axis last, padded to whole blocks.

* ``codes``: uint8. FP4 formats pack two E2M1 codes per byte along the last canonical dim;
  FP8 formats hold one E4M3 bit pattern per byte.
* ``scales``: one per block, shape ``layout.scale_shape``. E8M0 bytes for MX formats,
  E4M3 bytes for NVFP4, float32 for FP8 rowwise.
* ``tensor_scale``: NVFP4's FP32 encode scale ``s_enc`` (0-d tensor), else ``None``.

``t()`` is a *logical* transpose of a 2D tensor: no data moves, a flag flips. For 2D tiles
this is the same as quantizing the transposed tensor; for 1D blocks it yields blocks along
the other axis (so a GEMM that needs blocks along its inner dimension cannot use it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import e2m1, e4m3
from .layout import BlockLayout
from .ieee import true_div
from .scales import decode_e8m0


@dataclass(frozen=True)
class QuantizedTensor:
    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    layout: BlockLayout
    dtype: torch.dtype
    transposed: bool = False

    # ---- shape -------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        s = self.layout.shape
        return torch.Size((s[1], s[0]) if self.transposed else s)

    @property
    def ndim(self) -> int:
        return len(self.layout.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def block_axis(self) -> int | None:
        """The logical axis the 1D blocks run along (``None`` for 2D tiles)."""
        if self.layout.is_2d:
            return None
        return 1 - self.layout.axis if self.transposed else self.layout.axis

    def t(self) -> QuantizedTensor:
        """Logical transpose of a 2D quantized tensor (free: no data is touched)."""
        if self.ndim != 2:
            raise ValueError(f"t() needs a 2D quantized tensor, this one has shape {tuple(self.shape)}")
        return replace(self, transposed=not self.transposed)

    @property
    def T(self) -> QuantizedTensor:  # noqa: N802 - mirrors torch.Tensor.T
        return self.t()

    # ---- bytes ------------------------------------------------------------------------
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold the data (what autograd saves)."""
        ts = (self.codes, self.scales)
        return ts + ((self.tensor_scale,) if self.tensor_scale is not None else ())

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> QuantizedTensor:
        """The same metadata over ``tensors`` (inverse of :meth:`tensors`)."""
        codes, scales, *rest = tensors
        return replace(self, codes=codes, scales=scales, tensor_scale=rest[0] if rest else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # ---- values -----------------------------------------------------------------------
    @property
    def is_fp4(self) -> bool:
        return self.fmt in ("mxfp4", "nvfp4")

    def _decode_canonical(self, outer: bool = True) -> torch.Tensor:
        """Dequantized float32 values in the canonical (padded) layout; ``outer=False`` leaves out
        the factor that :meth:`scaled_bf16` keeps outside (NVFP4's ``s_enc``, FP8's row scale)."""
        return decode_canonical(self.fmt, self.codes, self.scales, self.tensor_scale, self.layout, outer)

    def _decode_canonical_eager(self, outer: bool = True) -> torch.Tensor:
        lay = self.layout
        if self.is_fp4:
            v = e2m1.decode(e2m1.unpack(self.codes))
        else:
            v = e4m3.decode(self.codes)
        if self.fmt in ("mxfp4", "mxfp8"):
            return v * lay.expand_scales(decode_e8m0(self.scales))
        if self.fmt == "nvfp4":
            # decode order: (q * sb) / s_enc. q * sb is exact (<= 6 significant bits); one rounding.
            sb = lay.expand_scales(e4m3.decode(self.scales))
            return true_div(v * sb, self.tensor_scale) if outer else v * sb
        if self.fmt == "fp8":
            return v * lay.expand_scales(self.scales) if outer else v
        raise AssertionError(self.fmt)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The represented values, in the original shape and ``dtype`` (default: the input's).

        Computed in FP32, then cast with saturation to ``dtype``'s finite range (a value that
        is finite in FP32 never becomes Inf in a narrower dtype); NaN stays NaN.
        """
        return self._dequantize(dtype or self.dtype, outer=True)

    def _dequantize(self, dtype: torch.dtype, outer: bool) -> torch.Tensor:
        x = self.layout.from_canonical(self._decode_canonical(outer))
        if self.transposed:
            x = x.mT
        if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(torch.float32).max:
            fmax = torch.finfo(dtype).max
            x = x.clamp(-fmax, fmax)
        return x.to(dtype)

    def scaled_bf16(self) -> ScaledBF16:
        """The values split *exactly* into BF16 element values and outer factors, the form a GEMM
        on BF16 tensor cores takes (:class:`ScaledBF16`). 2D tensors (GEMM operands) only.

        * MX formats: element x power-of-two scale (<= 4 significant bits): BF16 as is.
        * NVFP4: ``q * sb`` (<= 2 + 4 significant bits) and the divisor ``s_enc``.
        * FP8 rowwise: the E4M3 values (<= 4 significant bits) and the FP32 scale per row of
          the non-block axis.
        """
        if self.ndim != 2:
            raise ValueError(f"scaled_bf16 needs a 2D quantized tensor, this one has shape {tuple(self.shape)}")
        values = self._dequantize(torch.bfloat16, outer=False)
        if self.fmt == "nvfp4":
            return ScaledBF16(values, None, self.tensor_scale, self.block_axis)
        if self.fmt == "fp8":
            return ScaledBF16(values, self.scales.reshape(-1), None, self.block_axis)
        return ScaledBF16(values, None, None, self.block_axis)

    def element_values(self) -> torch.Tensor:
        """Unscaled element values (float32) in the original shape: the FP4/FP8 grid points."""
        v = e2m1.decode(e2m1.unpack(self.codes)) if self.is_fp4 else e4m3.decode(self.codes)
        x = self.layout.from_canonical(v)
        return x.mT if self.transposed else x

    def scale_values(self) -> torch.Tensor:
        """Per-block decoded scales (float32), ``layout.scale_shape``; for NVFP4 ``sb / s_enc``."""
        if self.fmt in ("mxfp4", "mxfp8"):
            return decode_e8m0(self.scales)
        if self.fmt == "nvfp4":
            return true_div(e4m3.decode(self.scales), self.tensor_scale)
        return self.scales

    def __repr__(self) -> str:
        geom = f"block={self.layout.block}" + ("" if self.layout.is_2d else f", axis={self.block_axis}")
        return (
            f"QuantizedTensor(fmt={self.fmt!r}, shape={tuple(self.shape)}, {geom}, "
            f"dtype={self.dtype}, nbytes={self.nbytes}{', transposed' if self.transposed else ''})"
        )


@dataclass(frozen=True)
class ScaledBF16:
    """A quantized 2D GEMM operand as exact BF16 values and outer factors:

    ``value[i, j] = values[i, j] * scale[r] / divisor`` with ``r`` the index along the axis
    that is *not* the block axis (``scale``, ``divisor`` optional). A GEMM multiplies
    ``values`` on BF16 tensor cores (every product exact, FP32 accumulation) and applies the
    factors to its output. :meth:`dequantize` recomposes the reference's FP32 values bit for
    bit (the same one multiplication or division per element as :class:`QuantizedTensor`).
    """

    values: torch.Tensor  # bfloat16, logical shape
    scale: torch.Tensor | None  # float32 [size of the non-block axis]
    divisor: torch.Tensor | None  # float32, 0-d
    block_axis: int | None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def device(self) -> torch.device:
        return self.values.device

    def t(self) -> ScaledBF16:
        """Transpose (a view; the scale stays with its axis)."""
        return replace(self, values=self.values.mT, block_axis=None if self.block_axis is None else 1 - self.block_axis)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = self.values.float()
        if self.scale is not None:
            x = x * (self.scale[:, None] if self.block_axis == 1 else self.scale[None, :])
        if self.divisor is not None:
            x = true_div(x, self.divisor)
        if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(torch.float32).max:
            x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
        return x.to(dtype)


def decode_canonical(fmt, codes, scales, tensor_scale, layout, outer: bool = True) -> torch.Tensor:
    """Dequantized float32 values in the canonical layout (a function of tensors, compile-friendly)."""
    q = QuantizedTensor(fmt, codes, scales, tensor_scale, layout, torch.float32)
    return q._decode_canonical_eager(outer)
