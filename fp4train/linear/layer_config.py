"""What the quantized linear's ops know of a converted layer - its spec, GEMM backend, numerics and seed source -
and the string that names it to them (:func:`config_key`: JSON, stable across processes, since Inductor caches
compiled graphs on disk with the ops' arguments in them)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from .. import backends
from ..quantizer import Quantizer
from ..recipes.spec import LinearSpec, _linear_from_dict, _to_plain


@dataclass(frozen=True)
class LayerConfig:
    """What the ops know of a converted layer: its spec, GEMM backend, numerics and seed source."""

    spec: LinearSpec
    backend_name: str
    numerics: str = "eager"
    device_seeds: bool = False

    @property
    def backend(self):
        return backends.get(self.backend_name)

    @property
    def quantizer(self) -> Quantizer:
        return Quantizer(self.numerics)

    @property
    def seeded_on_device(self) -> bool:
        """Do this layer's calls draw their seeds on the device (and draw one at all)?"""
        return self.device_seeds and self.spec.needs_seed


def config_key(cfg: LayerConfig) -> str:
    """The string that names ``cfg`` to the ops: its JSON (stable across processes)."""
    d = {"backend": cfg.backend_name, "linear": _to_plain(cfg.spec), "numerics": cfg.numerics}
    if cfg.device_seeds:
        d["device_seeds"] = True
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=None)
def parse(key: str) -> LayerConfig:
    """The :class:`LayerConfig` a :func:`config_key` names (a pure function, memoized)."""
    d = json.loads(key)
    return LayerConfig(_linear_from_dict(d["linear"]), d["backend"], d.get("numerics", "eager"), bool(d.get("device_seeds")))
