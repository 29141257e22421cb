"""Device seeds in one launch each: :mod:`fp4train.counter_rng`'s seed derivation as Triton programs.

Under CUDA graphs a layer that rounds stochastically draws its seed on the device
(:class:`~fp4train.device_seeds.DeviceSeedStream`) and derives each operand's keys there. Written as int64
tensor ops (:func:`~fp4train.counter_rng.derive_seed_tensor`, :func:`~fp4train.counter_rng.seed_keys_tensor`,
the reference) that is 167 tiny kernels per tib2d layer call, and a graph
replays each of them, a few microseconds apiece. Here one program does the whole chain on scalars:

* :func:`stream_next`: ``count += 1; seed = derive_seed(base, count)`` (the stream's next seed);
* :func:`derived_keys`: ``seed_keys(derive_seed(seed, *salt))`` as the int64 pair ``[key, key2]`` that the
  stochastic-rounding kernels read (``KEYS_PTR``).

The arithmetic is the reference's, in unsigned words instead of masked int64: a product mod 2**32 is a
uint32 product (it wraps), ``x & 0xFFFFFFFF`` is a cast to uint32, and the 62-bit seed lives in a uint64.
The results are the reference's bit for bit (tests, at the ends of the 62-bit range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mx_quantize import _lowbias32

_MASK62 = tl.constexpr((1 << 62) - 1)  # a constexpr: a jit function may read no other global


@triton.jit
def _derive(s, v):
    """One salt of ``counter_rng.derive_seed``: ``s`` a uint64 seed below 2**62, ``v`` a uint64 salt."""
    a = _lowbias32(s.to(tl.uint32) ^ (v.to(tl.uint32) * tl.full([], 0x632BE5AB, tl.uint32)))
    b = _lowbias32((s >> 32).to(tl.uint32) + v.to(tl.uint32))  # ((s >> 32) + v) mod 2**32
    return ((a.to(tl.uint64) << 30) ^ b.to(tl.uint64)) & tl.full([], _MASK62, tl.uint64)


@triton.jit
def _stream_next_kernel(base_ptr, count_ptr, out_ptr):
    count = tl.load(count_ptr) + 1
    tl.store(count_ptr, count)
    s = tl.load(base_ptr).to(tl.uint64) & tl.full([], _MASK62, tl.uint64)
    tl.store(out_ptr, _derive(s, count.to(tl.uint64)).to(tl.int64))


@triton.jit
def _derived_keys_kernel(seed_ptr, out_ptr, SALT0: tl.constexpr, SALT1: tl.constexpr, NSALT: tl.constexpr):
    s = tl.load(seed_ptr).to(tl.uint64) & tl.full([], _MASK62, tl.uint64)
    if NSALT >= 1:
        s = _derive(s, tl.full([], SALT0, tl.uint64))
    if NSALT >= 2:
        s = _derive(s, tl.full([], SALT1, tl.uint64))
    key = s.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32)  # (seed * golden) mod 2**32
    key2 = (s >> 32).to(tl.uint32) ^ tl.full([], 0x85EBCA6B, tl.uint32)
    tl.store(out_ptr, key.to(tl.int64))
    tl.store(out_ptr + 1, key2.to(tl.int64))


def _check_scalar(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int64 or t.numel() != 1:
        raise ValueError(f"{name} must be one int64 element, got {t.dtype} {tuple(t.shape)}")


def stream_next(base: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Advance ``count`` (in place) and return ``derive_seed(base, count)`` as a 0-d int64 tensor on its device."""
    _check_scalar("base", base)
    _check_scalar("count", count)
    out = torch.empty((), dtype=torch.int64, device=count.device)
    _stream_next_kernel[(1,)](base, count, out, num_warps=1)
    return out


def derived_keys(seed: torch.Tensor, *salt: int) -> torch.Tensor:
    """``seed_keys(derive_seed(seed, *salt))`` as an int64 tensor ``[key, key2]`` on ``seed``'s device
    (up to two salts, each in [0, 2**32): the GEMM and operand ids)."""
    _check_scalar("seed", seed)
    if len(salt) > 2 or any(not 0 <= int(v) < 2**32 for v in salt):
        raise ValueError(f"derived_keys takes up to two salts in [0, 2**32), got {salt}")
    s = [int(v) for v in salt] + [0] * (2 - len(salt))
    out = torch.empty(2, dtype=torch.int64, device=seed.device)
    _derived_keys_kernel[(1,)](seed, out, SALT0=s[0], SALT1=s[1], NSALT=len(salt), num_warps=1)
    return out
