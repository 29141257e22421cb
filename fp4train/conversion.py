"""``convert(model, recipe)``: swap ``nn.Linear`` modules for quantized ones, in place.

Swapping from the outside (no monkey-patching): every ``nn.Linear`` whose qualified name the
recipe does not exclude becomes a :class:`~fp4train.linear.QuantizedLinear` sharing the same
parameters, so ``state_dict`` keys, optimizer state and parameter identity are unchanged.
All shape problems are collected first and reported together, before anything is swapped.
"""

from __future__ import annotations

import re
import warnings
from typing import Callable

import torch
import torch.nn as nn

from . import backends
from . import recipes as _recipes
from .linear.lora_svd import LoRASVDLinear
from .linear.module import QuantizedLinear
from .linear.shared_input import SharedInput
from .quantizer import Quantizer
from .recipes.spec import Recipe

#: The transformer-block index of a module: the first ".<int>." in its qualified name.
BLOCK_INDEX = re.compile(r"(?:^|\.)(\d+)\.")


def convert(
    model: nn.Module,
    recipe: str | Recipe,
    *,
    filter: Callable[[str, nn.Linear], bool] | None = None,  # noqa: A002 - the public name
    backend: str | None = None,
    numerics: str | None = None,
    device_seeds: bool = False,
    calibrating: bool = False,
) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` layers for :class:`QuantizedLinear` as ``recipe`` says.

    Args:
        model: any module; its ``nn.Linear`` submodules are replaced in place.
        recipe: a preset name (``fp4train.recipes.names()``), a recipe file, or a Recipe.
        filter: ``filter(name, module) -> bool``; only modules for which it returns True are
            converted (on top of the recipe's own overrides).
        backend: GEMM backend name (``fp4train.backends.names()`` or ``"auto"``); default: the
            recipe's, ``"auto"`` for the presets: ``fp8_blockwise`` on a machine with a CUDA GPU, ``emulated``
            elsewhere.
        numerics: how the layers quantize their operands, the same bits each way
            (:class:`~fp4train.quantizer.Quantizer`): ``"eager"`` (the reference), ``"compiled"`` or
            ``"triton"``; default: ``"triton"`` for the ``fp8_blockwise`` backend on a machine with a CUDA GPU,
            else ``"eager"``. Each layer's operand plan (``print(layer)``) says which implementation
            prepares each operand and which GEMM multiplies them.
        device_seeds: draw the layers' stochastic-rounding seeds on the device, so that CUDA graphs
            capture seeded layers with fresh draws per replay (the trainer sets it with CUDA graphs).

        calibrating: for a recipe that calibrates (AdaHOP), say that a calibration follows (the trainer
            records one over the first steps); without it converting warns that the layers stay BF16.

    Returns ``model``. Raises ``ValueError`` naming every layer whose shape the recipe cannot
    run, with the fix, before changing anything.

    A recipe that calibrates (``recipe.calibrate``, AdaHOP) has no FP4 strategy until calibration gives
    one: its layers run in BF16 and say so (``QuantizedLinear.uncalibrated``). Calibrate with
    ``fp4train train`` (its first ``calibration_steps`` steps) or convert with the calibrated recipe,
    ``Calibration.load(file).recipe()``.
    """
    recipe = _recipes.get(recipe)
    if recipe.calibrate and not calibrating:
        warnings.warn(f"recipe {recipe.name!r} needs a calibration: until one is applied its layers run in BF16, not FP4. "
                      "Train with `fp4train train --recipe adahop` (it calibrates over the first "
                      f"{recipe.calibration_steps} steps) or convert with Calibration.load(FILE).recipe()",
                      UserWarning, stacklevel=2)
    backend = backends.resolve(backend or recipe.backend)  # "auto": fp8_blockwise on a GPU machine, emulated elsewhere
    if numerics is None:
        wanted = getattr(backends.get(backend), "numerics", None)
        numerics = wanted if wanted and torch.cuda.is_available() else "eager"
    Quantizer(numerics)  # refuses an unknown name before any layer is swapped
    if isinstance(model, nn.Linear):
        raise TypeError("convert() swaps submodules in place; wrap a bare nn.Linear, e.g. nn.Sequential(linear)")

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    indices = {n: block_index(n) for n, _ in linears}
    known = [i for i in indices.values() if i is not None]
    num_blocks = max(known) + 1 if known else None

    plan, problems = [], []
    for name, mod in linears:
        if filter is not None and not filter(name, mod):
            continue
        spec = recipe.spec_for(name, indices[name], num_blocks)
        if spec is None:
            if isinstance(mod, QuantizedLinear):  # a previous convert(): back to high precision
                plan.append((name, mod, None))
            continue
        if not mod.weight.dtype.is_floating_point:
            problems.append(f"  {name}: weight dtype {mod.weight.dtype} is not floating point")
            continue
        for p in spec.shape_problems(mod.in_features, mod.out_features):
            problems.append(f"  {name} (Linear {mod.in_features}->{mod.out_features}): {p}")
        plan.append((name, mod, spec))
    if problems:
        raise ValueError(
            f"recipe {recipe.name!r} cannot run these layers:\n"
            + "\n".join(problems)
            + "\nFix: exclude them with convert(..., filter=lambda name, m: name not in {...}), add an "
            "Override(pattern, None) to the recipe, or give the model dimensions that are multiples of the block size."
        )

    shared = SharedInput()  # the layers of this model that read one input prepare it once
    for i, (name, mod, spec) in enumerate(plan):
        if spec is None and isinstance(mod, LoRASVDLinear):
            new = mod.to_linear()  # one weight again: W_res + beta * B A
        elif spec is None:
            new = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(new)
            new.in_features, new.out_features, new.weight, new.bias = mod.in_features, mod.out_features, mod.weight, mod.bias
            new.train(mod.training)
        elif isinstance(mod, LoRASVDLinear):  # converted before: its split stays, the numerics follow the recipe
            mod._configure(spec, backend, numerics, device_seeds, recipe.name, shared)
            new = mod
        elif recipe.lora_svd is not None and spec.quantized:
            new = LoRASVDLinear.from_linear(mod, spec, lora=recipe.lora_svd, seed=i, backend=backend, numerics=numerics,
                                            device_seeds=device_seeds, recipe_name=recipe.name, shared_input=shared)
        else:
            new = QuantizedLinear.from_linear(mod, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                                             recipe_name=recipe.name, shared_input=shared)
            new.uncalibrated = recipe.calibrate is not None
        _set_submodule(model, name, new)
    if recipe.attention is not None:
        from .attention import set_attention

        try:
            set_attention(model, recipe.attention)
        except ValueError as e:  # the linears are converted all the same: a part of a model may have no attention
            warnings.warn(f"recipe {recipe.name!r} quantizes attention, but {e}", UserWarning, stacklevel=2)
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """Swap every quantized linear back to a plain ``nn.Linear``, in place: a :class:`QuantizedLinear` shares its
    parameters with the new layer; a LoRA-SVD layer becomes one weight, ``W_res + beta * B A``. Returns ``model``."""
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]:
        if isinstance(mod, LoRASVDLinear):
            new = mod.to_linear()
        else:
            new = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(new)
            new.in_features, new.out_features, new.weight, new.bias = mod.in_features, mod.out_features, mod.weight, mod.bias
        new.train(mod.training)
        _set_submodule(model, name, new)
    from .attention import switchable

    for m in model.modules():  # attention back to the model's own
        if switchable(m):
            m.attention = "sdpa"
    return model


def block_index(name: str) -> int | None:
    """The transformer-block index of a module name (first ".<int>."), or None."""
    m = BLOCK_INDEX.search(name + ".")
    return int(m.group(1)) if m else None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
