"""Recipes: what each GEMM operand of a linear layer becomes. Look them up by name.

>>> import fp4train
>>> fp4train.recipes.names()
['adahop', 'adahop_measured', 'bf16', 'fp8_rowwise', 'fullstack', 'hadamard_mxfp4', 'mxfp4', 'nvfp4', 'tib2d']
>>> r = fp4train.recipes.get("mxfp4")
"""

from __future__ import annotations

from pathlib import Path

from .presets import PRESETS
from .spec import (
    DEFAULT_OVERRIDES,
    HIGH_PRECISION,
    GemmSpec,
    LinearSpec,
    LoRASVDSpec,
    OutlierSpec,
    Override,
    QuantSpec,
    Recipe,
    TransformSpec,
)

_REGISTRY: dict[str, Recipe] = {r.name: r for r in PRESETS}


def register(recipe: Recipe, *, overwrite: bool = False) -> Recipe:
    """Make ``recipe`` available to :func:`get` (and the CLI) under ``recipe.name``."""
    if recipe.name in _REGISTRY and not overwrite:
        raise ValueError(f"a recipe named {recipe.name!r} exists; pass overwrite=True to replace it")
    _REGISTRY[recipe.name] = recipe
    return recipe


def names() -> list[str]:
    """Names of the registered recipes, sorted."""
    return sorted(_REGISTRY)


def get(name: str | Recipe) -> Recipe:
    """A registered recipe by name, a recipe file (``.json``/``.toml``), or a Recipe as is."""
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"recipe must be a name, a path or a Recipe, got {type(name).__name__}")
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.endswith((".json", ".toml")):
        if not Path(name).is_file():
            raise FileNotFoundError(f"recipe file {name!r} does not exist")
        return Recipe.load(name)
    raise ValueError(f"unknown recipe {name!r}; available: {', '.join(names())} (or a .json/.toml recipe file)")


def describe() -> str:
    """One line per registered recipe."""
    w = max(len(n) for n in _REGISTRY)
    return "\n".join(f"{n:<{w}}  {_REGISTRY[n].description}" for n in names())


__all__ = [
    "DEFAULT_OVERRIDES",
    "HIGH_PRECISION",
    "GemmSpec",
    "LinearSpec",
    "LoRASVDSpec",
    "OutlierSpec",
    "Override",
    "QuantSpec",
    "Recipe",
    "TransformSpec",
    "describe",
    "get",
    "names",
    "register",
]
