"""Counter-based random numbers: ``uniform(seed, index)`` is a pure function.

Stochastic rounding and random Hadamard signs need random numbers that are

* reproducible from a seed (a resumed run continues the same stream),
* the same on every device (CPU tests can check GPU results), and
* cheap to recompute inside a kernel from ``(seed, element index)`` alone, so that a
  Triton kernel and this reference produce *the same* draws bit for bit.

``torch.Generator`` gives none of the last two, so we hash the element's index with the
seed. The mixer is Chris Wellons' ``lowbias32`` (a bijection on 32-bit words with good
avalanche), applied twice with the seed folded in between. All arithmetic is on int64
tensors holding values < 2**32; the 32x32-bit products are split into 16-bit halves so
no intermediate ever exceeds 2**48 (no reliance on signed-overflow wrap-around).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    lo = x * c_lo  # < 2**48
    hi = ((x & 0xFFFF) * c_hi) & 0xFFFF  # only the low 16 bits survive the shift by 16
    return (lo + (hi << 16)) & _MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The ``lowbias32`` integer hash on int64 tensors holding 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys the hash mixes in for ``seed`` (kernels take these)."""
    return (int(seed) * _GOLDEN) & _MASK32, ((int(seed) >> 32) ^ 0x85EBCA6B) & _MASK32


def hash32(seed: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element of ``index`` (int64, taken mod 2**32) for ``seed``."""
    key, key2 = seed_keys(seed)
    return _hash_keys(index, key, key2)


def _hash_keys(index, key, key2):
    h = lowbias32((index & _MASK32) ^ key)
    return lowbias32(h ^ key2)


def uniform_keys(keys: torch.Tensor, shape: tuple[int, ...] | torch.Size, device=None, offset: int = 0) -> torch.Tensor:
    """:func:`uniform` with the seed given as its two keys in an int64 tensor (compile-friendly:
    a new seed is new data, not a new constant). ``keys`` may stay on the CPU (two 0-d scalars
    combine with device tensors without a host-to-device copy); the draws go to ``device``.
    ``offset``: the flat index of the first element (a part of a larger tensor draws what the whole would there)."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(offset, offset + n, device=device, dtype=torch.int64)
    bits = _hash_keys(idx, keys[0], keys[1]) >> 8
    return (bits.to(torch.float32) * (2.0**-24)).reshape(tuple(shape))


def uniform(seed: int, shape: tuple[int, ...] | torch.Size, device=None) -> torch.Tensor:
    """Float32 uniform draws in [0, 1) for every element of a row-major ``shape``.

    Element ``i`` (its flat row-major index) gets ``(hash32(seed, i) >> 8) * 2**-24``: 24 bits,
    exact in float32, never equal to 1.
    """
    return uniform_keys(torch.tensor(seed_keys(seed), dtype=torch.int64), tuple(int(s) for s in shape), device)


def random_signs(seed: int, n: int, device=None) -> torch.Tensor:
    """A float32 vector of ``n`` seeded +-1 signs (bit 31 of the hash).

    Made on the host from the seed (a Python int): a handful of signs as one copy to ``device`` (from pinned
    memory, asynchronously, on a GPU) rather than the two dozen tensor ops the hash takes - the same bits as
    :func:`random_signs_keys`, which makes them where a copy from the host cannot be kept: in a CUDA graph being
    captured (a replay would read a host buffer long since reused) and in a graph being compiled."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()):
        return random_signs_keys(torch.tensor(seed_keys(seed), dtype=torch.int64), n, device)
    key, key2 = seed_keys(seed)
    signs = torch.tensor([1.0 - 2.0 * (_lowbias32_int(_lowbias32_int(i ^ key) ^ key2) >> 31) for i in range(n)],
                         dtype=torch.float32)
    if device.type == "cuda":
        return signs.pin_memory().to(device, non_blocking=True)
    return signs.to(device)


def random_signs_keys(keys: torch.Tensor, n: int, device=None) -> torch.Tensor:
    """:func:`random_signs` with the seed given as its two keys in an int64 tensor ``[key, key2]``
    (:func:`seed_keys_tensor`, :func:`derived_keys_tensor`: a seed that lives on a device), the same signs:
    what a CUDA graph captures for a random Hadamard transform, drawing new signs on every replay. Keys on the
    CPU combine with a device's indices as two scalars (no host-to-device copy)."""
    idx = torch.arange(n, device=keys.device if device is None else device, dtype=torch.int64)
    bit = _hash_keys(idx, keys[0], keys[1]) >> 31
    return 1.0 - 2.0 * bit.to(torch.float32)


def _lowbias32_int(x: int) -> int:
    """:func:`lowbias32` on one Python int (host-side seed mixing, no tensors)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def derive_seed(seed: int, *salt: int) -> int:
    """A new 62-bit seed from ``seed`` and integer salts (e.g. a GEMM and operand id)."""
    s = int(seed) & ((1 << 62) - 1)
    for v in salt:
        a = _lowbias32_int((s ^ (v * 0x632BE5AB)) & _MASK32)
        b = _lowbias32_int(((s >> 32) + v) & _MASK32)
        s = ((a << 30) ^ b) & ((1 << 62) - 1)
    return s


def derive_seed_tensor(seed: torch.Tensor, *salt: int | torch.Tensor) -> torch.Tensor:
    """:func:`derive_seed` on int64 tensors (seeds in [0, 2**62), salts in [0, 2**62) as ints or tensors),
    bit for bit: the same mixing with every product taken mod 2**32 (:func:`_mul32`), so that a seed kept on a
    device is derived there - by ops a CUDA graph can capture - without a host round trip."""
    s = seed & ((1 << 62) - 1)
    for v in salt:
        vc = (v * 0x632BE5AB) & _MASK32 if isinstance(v, int) else _mul32(v & _MASK32, 0x632BE5AB)
        a = lowbias32((s & _MASK32) ^ vc)
        b = lowbias32(((s >> 32) + v) & _MASK32)
        s = ((a << 30) ^ b) & ((1 << 62) - 1)
    return s


def check_keys(keys: torch.Tensor, device=None) -> torch.Tensor:
    """``keys`` if it is a seed given as its keys - an int64 tensor ``[key, key2]`` (:func:`seed_keys_tensor`,
    :func:`derived_keys_tensor`), on ``device`` if one is named - else a ValueError that says what it should be."""
    if keys.shape != (2,) or keys.dtype != torch.int64 or (device is not None and keys.device != torch.device(device)):
        where = f" on the data's device {device}" if device is not None else ""
        raise ValueError(f"a seed given as a tensor must be its int64 keys [key, key2]{where} (counter_rng.seed_keys_tensor), "
                         f"got {keys.dtype} {tuple(keys.shape)} on {keys.device}")
    return keys


def seed_keys_tensor(seed: torch.Tensor) -> torch.Tensor:
    """:func:`seed_keys` of a 0-d int64 seed tensor as an int64 tensor ``[key, key2]`` on its device (what
    :func:`uniform_keys` and the kernels take)."""
    key = _mul32(seed & _MASK32, _GOLDEN)  # (seed * golden) mod 2**32 depends on seed mod 2**32 only
    key2 = ((seed >> 32) ^ 0x85EBCA6B) & _MASK32
    return torch.stack([key, key2])


def derived_keys_tensor(seed: torch.Tensor, *salt: int) -> torch.Tensor:
    """``seed_keys_tensor(derive_seed_tensor(seed, *salt))``: an operand's stochastic-rounding keys from a
    layer seed that lives on a device (int64 tensor ops; :func:`fp4train.device_seeds.derived_keys` runs the
    same as one kernel launch on a GPU)."""
    return seed_keys_tensor(derive_seed_tensor(seed, *salt))


def fresh_seed() -> int:
    """A seed drawn from torch's default CPU generator (so ``torch.manual_seed`` governs it).

    Uses the CPU generator on purpose: no device sync, and its state is what a checkpoint
    saves with ``torch.get_rng_state()``.
    """
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
