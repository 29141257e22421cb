"""Seeds that live on a device: a stream of per-call seeds a CUDA graph can capture, and the derivation of
an operand's keys from one, each a single kernel launch on a GPU.

The arithmetic is :mod:`fp4train.counter_rng`'s (``derive_seed_tensor``, ``seed_keys_tensor``); on a GPU the
Triton programs of :mod:`fp4train.kernels.seeds` compute the same bits in one launch instead of some 100 tiny
kernels, each of which a CUDA graph would replay. The streams are kept per device, like torch's own device
generators, and a checkpoint saves their state (:func:`device_seed_state`).
"""

from __future__ import annotations

import torch

from .counter_rng import derive_seed_tensor, derived_keys_tensor, fresh_seed
from .quantizer import kernels_usable_on


def derived_keys(seed: torch.Tensor, *salt: int) -> torch.Tensor:
    """:func:`~fp4train.counter_rng.derived_keys_tensor` - an operand's stochastic-rounding keys from a layer
    seed on a device - as one Triton launch where the kernels run (:func:`fp4train.kernels.seeds.derived_keys`)."""
    if len(salt) <= 2 and kernels_usable_on(seed):
        from .kernels.seeds import derived_keys as kernel

        return kernel(seed, *salt)
    return derived_keys_tensor(seed, *salt)


class DeviceSeedStream:
    """Per-call seeds made on a device, by ops a CUDA graph can capture: call ``n``'s seed is
    ``derive_seed(base, n)`` (:func:`derive_seed_tensor`), an int64 0-d tensor that never visits the host.

    ``base`` is drawn from torch's CPU generator when the stream is made (so ``torch.manual_seed`` governs it);
    the call counter lives on the device and is advanced by each :meth:`next`. Replayed as a CUDA graph, the
    captured ``next`` advances the counter again, so each replay draws fresh seeds - which a seed drawn on the
    host at capture time would not. Make the stream before any capture (its tensors must not live in a graph's
    memory pool): :func:`device_seed_stream` is called when a quantized layer arrives on its device.
    """

    def __init__(self, device, base: int | None = None):
        self.base = fresh_seed() if base is None else int(base)
        self._base = torch.tensor(self.base, dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def next(self) -> torch.Tensor:
        """The next call's seed (0-d int64 on the stream's device); on a GPU one Triton launch
        (:func:`fp4train.kernels.seeds.stream_next`), elsewhere the reference's int64 ops."""
        if kernels_usable_on(self.count):
            from .kernels.seeds import stream_next

            return stream_next(self._base, self.count)
        self.count.add_(1)
        return derive_seed_tensor(self._base, self.count)

    def state_dict(self) -> dict:
        return {"base": self.base, "count": int(self.count)}  # one host read: at checkpoint time only

    def load_state_dict(self, st: dict) -> None:
        self.base = int(st["base"])
        self._base.fill_(self.base)
        self.count.fill_(int(st["count"]))


_STREAMS: dict[torch.device, DeviceSeedStream] = {}


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_seed_stream(device) -> DeviceSeedStream:
    """This process's seed stream on ``device`` (made on first use)."""
    device = _device_key(device)
    if device not in _STREAMS:
        _STREAMS[device] = DeviceSeedStream(device)
    return _STREAMS[device]


def restart_device_seed_stream(device) -> DeviceSeedStream:
    """The stream on ``device``, made or restarted now with a new base from torch's CPU generator and its count
    at 0 - the same draw whether the process had made one before (a run's seeds must not depend on what ran
    earlier in the process). An existing stream keeps its tensors: graphs captured with them stay valid."""
    base = fresh_seed()  # one draw either way
    device = _device_key(device)
    if device not in _STREAMS:
        _STREAMS[device] = DeviceSeedStream(device, base=base)
    else:
        _STREAMS[device].load_state_dict({"base": base, "count": 0})
    return _STREAMS[device]


def device_seed_state() -> dict:
    """Every stream's state by device name (what a checkpoint saves beside torch's RNG states)."""
    return {str(d): s.state_dict() for d, s in _STREAMS.items()}


def load_device_seed_state(state: dict) -> None:
    for name, st in state.items():
        device_seed_stream(name).load_state_dict(st)
