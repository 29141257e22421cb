"""Optimizer states stored in NVFP4 (Full-Stack FP4, docs/methods.md): encode on store, exact inverse on load.

A state tensor ``[..., K]`` whose last two dims are whole 16x16 tiles (``K % 16 == 0``, rows a multiple of 16
after flattening the leading dims) is kept as plain tensors - codes and scales of an NVFP4 tensor (1x16 blocks
along the last dim, E4M3 block scales, one FP32 tensor scale) - so that a checkpoint holds them like any other
state and ``torch.load(weights_only=True)`` reads them back. Two codecs:

* :func:`encode_signed` / :func:`decode_signed` (AdamW's first moment, any signed state): ``Q(m)``.
* :func:`encode_second_moment` / :func:`decode_second_moment` (AdamW's second moment ``v >= 0``):

      r = sqrt(v)                       # the scale Adam divides by: its dynamic range halves
      mu = mean of r over each 16x16 tile, stored in FP32 (1/256 of the elements)
      y = H16(r - mu)                   # block Hadamard along the last dim: the tile's spread over its entries
      store Q(y)                        # NVFP4, nearest rounding

  and on load ``v' = max(H16^-1(Q(y)) + mu, FLOOR * mu)^2``. ``r`` is positive with a large common part in a
  tile; NVFP4 with that part in every block spends its scale on it and flushes the small entries - exactly
  the denominators that blow up an update. Subtracting the tile mean leaves the variation, and the Hadamard
  transform spreads heavy-tailed entries over their block, so the block scales fit the residual.

  The floor is fp4train's choice, not the paper's: in a tile with a heavy-tailed entry the Hadamard spreads
  that entry's quantization error over the whole block, and a small ``r`` can come back at or below zero -
  an update of ``m / eps``. Reading such entries as at least a quarter of the tile's mean over-estimates ``v``
  there (a smaller, safe step) and leaves tiles without such an entry as they were (``tests/test_optim.py``).

Rounding: a state re-encoded every step must not stick. With round-to-nearest, an entry on an E2M1 grid point
``q`` whose block scale is held by another entry comes back as ``q`` after any decay by ``beta`` >= 0.75 (0.9 * 6
rounds to 6, 0.9 * 4 to 4, ...), so it never decays while its gradient is zero, and a moment stops following its
gradients. The encoders therefore take stochastic-rounding ``keys`` (the optimizers give every parameter and
step its own, derived from a seed, so a resumed run draws the same): each entry rounds up or down with the
probabilities that make the stored value equal to the FP32 one in expectation, and a decaying entry decays. The
price is noise of the size of one encode's error per step, which the moment's own averaging damps
(``bench/optimizer_states.py`` measures both against an FP32 twin over a thousand steps). Without keys the
encoders round to nearest (a single encode's error is smaller; what a checkpoint of FP32 states converts with).

Tensors that do not fit (biases, norms, odd shapes) are not encoded: :func:`fits` says which.

A state split by rows over processes (a sharded parameter's, :mod:`fp4train.row_shards`) is encoded
shard by shard with the whole tensor's scale: the encoders take ``amax_over``, which turns a shard's amax into
the whole tensor's (an all-reduce), so that the shards' codes are the rows of the whole tensor's codes.
"""

from __future__ import annotations

import functools

import torch

from .. import counter_rng
from ..formats import nvfp4
from ..formats.qtensor import QuantizedTensor
from ..formats.quantize import quantize_tensors
from ..transforms.hadamard import hadamard

TILE = 16  #: NVFP4's block length; the mean tile is TILE x TILE and the Hadamard block TILE long
FLOOR = 0.25  #: a decoded sqrt(v) is at least this fraction of its tile's mean (see the module docstring)


def fits(shape: torch.Size | tuple[int, ...]) -> bool:
    """Can a state of this shape be stored in NVFP4 (at least 2D, both trailing dims multiples of 16)?"""
    return len(shape) >= 2 and shape[-1] % TILE == 0 and (_rows(shape) % TILE == 0)


def _rows(shape) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


#: NVFP4 in 1x16 blocks along the last dim of a ``[rows, cols]`` state, nearest rounding
_NVFP4_ROWS = dict(fmt="nvfp4", block=(TILE,), axis=1, scale="floor", four_over_six=False)


@functools.lru_cache(maxsize=1024)  # one entry per state shape
def _layout(rows: int, cols: int) -> QuantizedTensor:
    """The metadata of an NVFP4 ``[rows, cols]`` state (derived on a meta tensor: nothing is stored besides the
    tensors)."""
    return quantize_tensors(torch.empty(rows, cols, device="meta"), None, **_NVFP4_ROWS)


def _store(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    codes, scales, tensor_scale = q.tensors()
    return {"codes": codes, "scales": scales, "tensor_scale": tensor_scale}


def _load(stored: dict[str, torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    meta = (_layout.__wrapped__ if torch.compiler.is_compiling() else _layout)(rows, cols)  # the compiler traces it once
    q = meta.with_tensors((stored["codes"], stored["scales"], stored["tensor_scale"]))
    return q.dequantize(torch.float32)


def _nvfp4(x: torch.Tensor, amax_over, keys: torch.Tensor | None = None, offset: int = 0) -> QuantizedTensor:
    """NVFP4 of the FP32 ``x`` ``[rows, cols]``; the tensor scale from ``amax_over(x's amax)`` where given (a shard
    encoded with the whole tensor's scale), else from ``x``'s own. ``keys``: stochastic rounding, the uniforms of
    element ``offset + i`` of the whole state (a shard's first element is ``offset``); None: nearest."""
    if amax_over is None and keys is None:
        return quantize_tensors(x, None, **_NVFP4_ROWS)

    def encode(xb, _keys, fmt, element, scale, four_over_six):
        ts = nvfp4.scale_from_amax(amax_over(nvfp4.finite_amax(xb)) if amax_over is not None else nvfp4.finite_amax(xb))
        u = None if keys is None else counter_rng.uniform_keys(keys, xb.shape, xb.device, offset)
        return (*nvfp4.encode_blocks(xb, ts, u=u), ts)

    return quantize_tensors(x, None, **_NVFP4_ROWS, encode=encode)


def encode_signed(m: torch.Tensor, *, amax_over=None, keys: torch.Tensor | None = None, offset: int = 0) -> dict[str, torch.Tensor]:
    """A signed state ``m`` (``fits(m.shape)``) as NVFP4 tensors (``amax_over``, ``keys`` - stochastic rounding -
    and a shard's element ``offset``: see the module docstring)."""
    return _store(_nvfp4(_as_2d(m.float()), amax_over, keys, offset))


def decode_signed(stored: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The FP32 state :func:`encode_signed` stored, in ``shape``."""
    return _load(stored, _rows(shape), shape[-1]).reshape(shape)


def _tiles(r: torch.Tensor) -> torch.Tensor:
    """``r`` ``[rows, cols]`` viewed as ``[rows/16, 16, cols/16, 16]`` (no copy): a tile's mean broadcasts over it."""
    rows, cols = r.shape
    return r.view(rows // TILE, TILE, cols // TILE, TILE)


def encode_second_moment(v: torch.Tensor, *, amax_over=None, keys: torch.Tensor | None = None,
                         offset: int = 0) -> dict[str, torch.Tensor]:
    """A non-negative state ``v`` (``fits(v.shape)``) as: NVFP4 of ``H16(sqrt(v) - tile mean)`` and the FP32 tile means
    (``amax_over``, ``keys``, ``offset``: see the module docstring)."""
    r = _as_2d(v.float()).clamp_min(0).sqrt()
    tiles = _tiles(r)
    mu = tiles.mean(dim=(1, 3))
    y = hadamard((tiles - mu[:, None, :, None]).reshape(r.shape), TILE, axis=-1)
    return {**_store(_nvfp4(y, amax_over, keys, offset)), "tile_mean": mu}


def decode_second_moment(stored: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The FP32 state :func:`encode_second_moment` stored, in ``shape``: ``max(H16^-1(y) + mu, FLOOR * mu)^2``."""
    y = _load(stored, _rows(shape), shape[-1])
    mu = stored["tile_mean"][:, None, :, None]
    r = _tiles(hadamard(y, TILE, axis=-1, inverse=True)) + mu
    return torch.maximum(r, FLOOR * mu).square().reshape(shape)


def stored_bytes(stored: dict[str, torch.Tensor]) -> int:
    """Bytes a stored state takes (codes, scales, tensor scale, tile means)."""
    return sum(t.numel() * t.element_size() for t in stored.values())
