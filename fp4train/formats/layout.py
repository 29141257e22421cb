"""Where the block scales sit: 1D blocks along one axis, or 2D square tiles.

Quantization works on a *canonical* arrangement of the tensor:

* 1D block ``b`` along ``axis``: the axis is moved last and zero-padded to a multiple of
  ``b``; canonical shape ``(*rest, Kp)``. One scale per ``b`` consecutive elements.
* 2D tile ``(b, b)``: the last two dims are zero-padded to multiples of ``b``; canonical
  shape ``(*lead, Rp, Cp)``. One scale per ``b x b`` tile. Transposing the tensor maps every
  tile onto a tile, so the transpose of the quantized tensor *is* the quantization of the
  transpose (arXiv 2607.24953) - the property 1D blocks lack.

Zero padding never changes a block's maximum, so padded and unpadded blocks get the same
scale; the padding is cropped on dequantize.

``blockify`` views a canonical tensor as ``(*scale_shape, elements_per_block)`` so that every
format's math is written once, over the last dim; ``unblockify`` is its inverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """Block geometry of a quantized tensor.

    ``block`` is ``(b,)`` for 1D blocks along ``axis`` or ``(b, b)`` for 2D tiles over the last
    two dims (``axis`` is then ``None``). ``shape`` is the original (logical) shape.
    """

    shape: tuple[int, ...]
    block: tuple[int, ...]
    axis: int | None

    @property
    def is_2d(self) -> bool:
        return len(self.block) == 2

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        if self.is_2d:
            b = self.block[0]
            *lead, r, c = self.shape
            return (*lead, _round_up(r, b), _round_up(c, b))
        rest = [s for i, s in enumerate(self.shape) if i != self.axis]
        return (*rest, _round_up(self.shape[self.axis], self.block[0]))

    @property
    def scale_shape(self) -> tuple[int, ...]:
        cs = self.canonical_shape
        if self.is_2d:
            b = self.block[0]
            return (*cs[:-2], cs[-2] // b, cs[-1] // b)
        return (*cs[:-1], cs[-1] // self.block[0])

    def to_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """Original tensor -> canonical (axis last / tiles aligned), zero padded."""
        if self.is_2d:
            b = self.block[0]
            pr, pc = -x.shape[-2] % b, -x.shape[-1] % b
            return F.pad(x, (0, pc, 0, pr)) if pr or pc else x
        x = x.movedim(self.axis, -1)
        pk = -x.shape[-1] % self.block[0]
        return F.pad(x, (0, pk)) if pk else x

    def from_canonical(self, xc: torch.Tensor) -> torch.Tensor:
        """Canonical tensor -> original shape (crop the padding, move the axis back)."""
        if self.is_2d:
            return xc[..., : self.shape[-2], : self.shape[-1]]
        return xc[..., : self.shape[self.axis]].movedim(-1, self.axis)

    def blockify(self, xc: torch.Tensor) -> torch.Tensor:
        """Canonical ``(..., Kp)`` or ``(..., Rp, Cp)`` -> ``(*scale_shape, numel_per_block)``."""
        if self.is_2d:
            b = self.block[0]
            *lead, rp, cp = xc.shape
            t = xc.reshape(*lead, rp // b, b, cp // b, b).transpose(-3, -2)
            return t.reshape(*lead, rp // b, cp // b, b * b)
        b = self.block[0]
        return xc.reshape(*xc.shape[:-1], xc.shape[-1] // b, b)

    def unblockify(self, xb: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`blockify`."""
        if self.is_2d:
            b = self.block[0]
            *lead, nr, nc, _ = xb.shape
            t = xb.reshape(*lead, nr, nc, b, b).transpose(-3, -2)
            return t.reshape(*lead, nr * b, nc * b)
        return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])

    def expand_scales(self, s: torch.Tensor) -> torch.Tensor:
        """Per-block values ``(*scale_shape)`` -> per-element canonical tensor."""
        if self.is_2d:
            b = self.block[0]
            return s.repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)
        return s.repeat_interleave(self.block[0], dim=-1)


def _round_up(n: int, b: int) -> int:
    return -(-n // b) * b
