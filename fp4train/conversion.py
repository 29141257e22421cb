"""``convert(model, recipe)``: swap ``nn.Linear`` modules for quantized ones, in place.

Swapping from the outside (no monkey-patching): every ``nn.Linear`` whose qualified name the
recipe does not exclude becomes a :class:`~fp4train.linear.QuantizedLinear` sharing the same
parameters, so ``state_dict`` keys, optimizer state and parameter identity are unchanged.
All shape problems are collected first and reported together, before anything is swapped.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Callable

import torch
import torch.nn as nn

from . import backends
from . import recipes as _recipes
from .conversion_report import (CONVERTED, HIGH_PRECISION, SKIPPED, ConversionReport, Entry, describe_spec, unhandled_reason,
                                weight_bearing)
from .linear.conv1d import QuantizedConv1D, in_out, is_conv1d
from .linear import experts as _experts
from .linear.lora_svd import LoRASVDConv1D, LoRASVDLinear
from .linear.module import QuantizedLinear
from .linear.shared_input import SharedInput
from .quantizer import Quantizer
from .recipes.spec import Recipe

#: The transformer-block index of a module: the first ".<int>." in its qualified name.
BLOCK_INDEX = re.compile(r"(?:^|\.)(\d+)\.")


#: Said of a LoRA-SVD recipe's experts, in the report and a warning: their weights have no low-rank branch.
NO_EXPERT_LORA = "without LoRA-SVD: the recipe's low-rank branch covers linear layers, not stacked experts"


def convert(
    model: nn.Module,
    recipe: str | Recipe,
    *,
    filter: Callable[[str, nn.Linear], bool] | None = None,  # noqa: A002 - the public name
    backend: str | None = None,
    numerics: str | None = None,
    device_seeds: bool = False,
    calibrating: bool = False,
    strict: bool = False,
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
        strict: refuse (``ValueError``, before changing anything) a model with a weight-bearing module that
            fp4train has no quantized layer for; without it such modules stay as they are, with a warning.

    Converted: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's transposed linear, kept transposed). Returns
    ``model``, with ``model.fp4train_conversion`` (:class:`~fp4train.conversion_report.ConversionReport`): every
    weight-bearing module converted (and its spec), kept in high precision (and why) or skipped; its summary goes
    to the ``fp4train`` logger. Raises ``ValueError`` naming every layer whose shape the recipe cannot run, with
    the fix, before changing anything.

    A recipe that calibrates (``recipe.calibrate``, AdaHOP) has no FP4 strategy until calibration gives
    one: its layers run in BF16 and say so (``QuantizedLinear.uncalibrated``). Calibrate with
    :func:`fp4train.calibrate` (any model), with
    ``fp4train train`` (its first ``calibration_steps`` steps) or convert with the calibrated recipe,
    ``Calibration.load(file).recipe()``.
    """
    recipe = _recipes.get(recipe)
    if recipe.calibrate and not calibrating:
        warnings.warn(f"recipe {recipe.name!r} needs a calibration: until one is applied its layers run in BF16, not FP4. "
                      "Calibrate any model with fp4train.calibrate(model, batches) (it converts the model to the "
                      "calibrated recipe), train with `fp4train train --recipe adahop` (it calibrates over the first "
                      f"{recipe.calibration_steps} steps), or convert with Calibration.load(FILE).recipe()",
                      UserWarning, stacklevel=2)
    backend = backends.resolve(backend or recipe.backend)  # "auto": fp8_blockwise on a GPU machine, emulated elsewhere
    if numerics is None:
        wanted = getattr(backends.get(backend), "numerics", None)
        numerics = wanted if wanted and torch.cuda.is_available() else "eager"
    Quantizer(numerics)  # refuses an unknown name before any layer is swapped
    if isinstance(model, nn.Linear):
        raise TypeError("convert() swaps submodules in place; wrap a bare nn.Linear, e.g. nn.Sequential(linear)")

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)]
    indices = {n: block_index(n) for n, _ in linears}
    known = [i for i in indices.values() if i is not None]
    num_blocks = max(known) + 1 if known else None

    if recipe.attention == "nvfp4":  # what the attention cannot run is refused before anything changes
        from .attention import unsupported

        if attention_problems := unsupported(model):
            raise ValueError(f"recipe {recipe.name!r} quantizes attention (NVFP4), which {type(model).__name__}'s attention "
                             f"cannot run: {'; '.join(attention_problems)}")
    report = ConversionReport(recipe.name)
    plan, problems = [], []
    roles = _roles(model, recipe)
    # an LM head found by structure: a linear whose weight is an input embedding's (tied), whatever its name
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head_kept = recipe.spec_for("lm_head", roles=frozenset({"lm_head"})) is None
    experts, routers = _experts.mixtures_of_experts(model)
    for name, mod in linears:
        kind = type(mod).__name__
        if filter is not None and not filter(name, mod):
            report.entries.append(Entry(name, kind, HIGH_PRECISION, "left out by convert()'s filter"))
            continue
        if name in routers:
            report.entries.append(Entry(name, kind, HIGH_PRECISION, routers[name]))
            if isinstance(mod, QuantizedLinear):
                plan.append((name, mod, None))
            continue
        if head_kept and id(mod.weight) in embeddings:
            report.entries.append(Entry(name, kind, HIGH_PRECISION, "an LM head tied to the input embedding: the recipe "
                                                                    "keeps the LM head in high precision"))
            if isinstance(mod, QuantizedLinear):
                plan.append((name, mod, None))
            continue
        own = roles.get(name, frozenset()) if roles is not None else None
        spec = recipe.spec_for(name, indices[name], num_blocks, roles=own)
        if spec is None:
            why = ("the LM head (its output is the vocabulary, shaped as the input embedding): the recipe keeps it in "
                   "high precision" if own and "lm_head" in own else
                   "the recipe keeps it in high precision (its overrides or keep_last_blocks)")
            report.entries.append(Entry(name, kind, HIGH_PRECISION, why))
            if isinstance(mod, QuantizedLinear):  # a previous convert(): back to high precision
                plan.append((name, mod, None))
            continue
        n_in, n_out = in_out(mod)
        if not mod.weight.dtype.is_floating_point:
            problems.append(f"  {name}: weight dtype {mod.weight.dtype} is not floating point")
            continue
        for p in spec.shape_problems(n_in, n_out):
            problems.append(f"  {name} ({kind} {n_in}->{n_out}): {p}")
        lora = " (LoRA-SVD)" if recipe.lora_svd is not None else ""
        report.entries.append(Entry(name, kind, CONVERTED, describe_spec(spec) + lora) if spec.quantized
                              else Entry(name, kind, HIGH_PRECISION, "its spec quantizes nothing"))
        plan.append((name, mod, spec))
    experts_plan, expert_without_lora = [], []
    for name, mod in experts:
        specs = {p: (recipe.spec_for(f"{name}.{p}", block_index(name), num_blocks, roles=frozenset() if roles is not None else None)
                     if filter is None or filter(name, mod) else None) for p in _experts.projections(mod)}
        for p, spec in specs.items():
            n_in, n_out = _experts.dims(mod, p)
            for problem in spec.shape_problems(n_in, n_out) if spec is not None else ():
                problems.append(f"  {name}.{p} ({mod.num_experts} experts {n_in}->{n_out}): {problem}")
        quantized = {p: s for p, s in specs.items() if s is not None and s.quantized}
        detail = (f"{mod.num_experts} experts, each a quantized GEMM per projection: "
                  + "; ".join(f"{p}: {describe_spec(s)}" for p, s in quantized.items()) if quantized
                  else "the recipe keeps its experts in high precision")
        if quantized and recipe.lora_svd is not None:
            detail += f" ({NO_EXPERT_LORA})"
            expert_without_lora.append(name)
        report.entries.append(Entry(name, type(mod).__name__, CONVERTED if quantized else HIGH_PRECISION, detail))
        experts_plan.append((mod, quantized))
    if expert_without_lora:
        warnings.warn(f"recipe {recipe.name!r}: {len(expert_without_lora)} experts modules ({expert_without_lora[0]}, ...) run "
                      f"its quantized GEMMs but {NO_EXPERT_LORA}", UserWarning, stacklevel=2)
    linear_names = {n for n, _ in linears}
    for name, why in routers.items():
        if name not in linear_names:  # a router module of its own (a linear router has its entry above)
            report.entries.append(Entry(name, type(model.get_submodule(name)).__name__, HIGH_PRECISION, why))
    handled = linear_names | {n for n, _ in experts} | set(routers)
    for name, mod in model.named_modules():
        if name in handled or not weight_bearing(mod) or isinstance(mod, (nn.Linear, QuantizedLinear)):
            continue
        status = HIGH_PRECISION if isinstance(mod, nn.Embedding) else SKIPPED
        report.entries.append(Entry(name, type(mod).__name__, status, unhandled_reason(mod)))
    skipped = report.of(SKIPPED)
    if strict and skipped:
        problems += [f"  {e}" for e in skipped]
    if problems:
        raise ValueError(
            f"recipe {recipe.name!r} cannot run these layers:\n"
            + "\n".join(problems)
            + "\nFix: exclude them with convert(..., filter=lambda name, m: name not in {...}), add an "
            "Override(pattern, None) to the recipe, or give the model dimensions that are multiples of the block size"
            + ("; skipped modules: convert without strict=True to leave them in high precision" if strict and skipped else "")
            + "."
        )

    shared = SharedInput()  # the layers of this model that read one input prepare it once
    for i, (name, mod, spec) in enumerate(plan):
        if spec is None and isinstance(mod, LoRASVDLinear):
            new = mod.to_linear()  # one weight again: W_res + beta * B A
        elif spec is None and isinstance(mod, QuantizedConv1D):
            new = mod.to_conv1d()
        elif spec is None:
            new = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(new)
            new.in_features, new.out_features, new.weight, new.bias = mod.in_features, mod.out_features, mod.weight, mod.bias
            new.train(mod.training)
        elif isinstance(mod, LoRASVDLinear):  # converted before: its split stays, the numerics follow the recipe
            mod._configure(spec, backend, numerics, device_seeds, recipe.name, shared)
            new = mod
        elif isinstance(mod, QuantizedConv1D):  # converted before: the numerics follow the recipe
            mod._configure(spec, backend, numerics, device_seeds, recipe.name, shared)
            new = mod
        elif is_conv1d(mod) and recipe.lora_svd is not None and spec.quantized:
            new = LoRASVDConv1D.from_conv1d(mod, spec, lora=recipe.lora_svd, seed=i, backend=backend, numerics=numerics,
                                            device_seeds=device_seeds, recipe_name=recipe.name, shared_input=shared)
        elif is_conv1d(mod):
            new = QuantizedConv1D.from_conv1d(mod, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                                              recipe_name=recipe.name, shared_input=shared)
            new.uncalibrated = recipe.calibrate is not None
        elif recipe.lora_svd is not None and spec.quantized:
            new = LoRASVDLinear.from_linear(mod, spec, lora=recipe.lora_svd, seed=i, backend=backend, numerics=numerics,
                                            device_seeds=device_seeds, recipe_name=recipe.name, shared_input=shared)
        else:
            new = QuantizedLinear.from_linear(mod, spec, backend=backend, numerics=numerics, device_seeds=device_seeds,
                                             recipe_name=recipe.name, shared_input=shared)
            new.uncalibrated = recipe.calibrate is not None
        _set_submodule(model, name, new)
    _set_experts(model, [(mod, _experts.QuantizedExperts(specs, backend, numerics, device_seeds) if specs else None)
                         for mod, specs in experts_plan])
    if recipe.attention is not None:
        from .attention import set_attention

        try:
            set_attention(model, recipe.attention)
        except ValueError as e:  # the linears are converted all the same: a part of a model may have no attention
            warnings.warn(f"recipe {recipe.name!r} quantizes attention, but {e}", UserWarning, stacklevel=2)
    model.fp4train_conversion = report
    logging.getLogger("fp4train").info("%s", report.summary())
    if skipped:
        warnings.warn(f"{report.summary()}: the skipped modules stay in high precision ({'; '.join(map(str, skipped[:3]))}"
                      f"{'; ...' if len(skipped) > 3 else ''}). convert(..., strict=True) refuses such a model; "
                      "model.fp4train_conversion lists every module", UserWarning, stacklevel=2)
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """Swap every quantized linear back to a plain ``nn.Linear``, in place: a :class:`QuantizedLinear` shares its
    parameters with the new layer; a LoRA-SVD layer becomes one weight, ``W_res + beta * B A``. Returns ``model``."""
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]:
        if isinstance(mod, LoRASVDLinear):
            new = mod.to_linear()
        elif isinstance(mod, QuantizedConv1D):
            new = mod.to_conv1d()
        else:
            new = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(new)
            new.in_features, new.out_features, new.weight, new.bias = mod.in_features, mod.out_features, mod.weight, mod.bias
        new.train(mod.training)
        _set_submodule(model, name, new)
    _set_experts(model, [(m, None) for m in model.modules() if _experts.is_experts(m)])
    from .attention import HF_NAME, hf_configs, set_attention, switchable

    for m in model.modules():  # attention back to the model's own
        if switchable(m):
            m.attention = "sdpa"
    if any(config._attn_implementation == HF_NAME for _, config in hf_configs(model)):
        set_attention(model, "sdpa")  # a Hugging Face model: the implementation it had before
    return model


def _set_experts(model: nn.Module, plan: list) -> None:
    """Give each experts module of ``plan`` (``[(module, QuantizedExperts or None)]``) its quantized GEMMs (None: its
    weights' own), and their configs the experts implementation that runs them (fp4train's where any is quantized,
    else the one the model had)."""
    on = any(q is not None for _, q in plan)
    if on and any(hasattr(mod, "config") for mod, _ in plan):  # a transformers model's experts
        _experts.register_hf()
    for mod, quantized in plan:
        if quantized is None:
            mod.__dict__.pop("fp4train_experts", None)
        else:
            mod.fp4train_experts = quantized
        config = getattr(mod, "config", None)
        if config is None:  # fp4train's own experts (fp4train.models.moe) run experts_forward themselves
            continue
        if on and config._experts_implementation != _experts.HF_NAME:
            model.fp4train_experts_before = config._experts_implementation
            config._experts_implementation = _experts.HF_NAME
        elif not on and config._experts_implementation == _experts.HF_NAME:
            config._experts_implementation = getattr(model, "fp4train_experts_before", None) or "eager"


def block_index(name: str) -> int | None:
    """The transformer-block index of a module name (first ".<int>."), or None."""
    m = BLOCK_INDEX.search(name + ".")
    return int(m.group(1)) if m else None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _roles(model: nn.Module, recipe) -> dict | None:
    """The roles of ``model``'s linears where ``recipe``'s overrides name roles (None: it names none). Attention's
    roles take one forward pass (fp4train.roles), once per model: kept as ``model.fp4train_roles``. Where no pass
    can find them, they come from the usual layer names, with a warning."""
    named = recipe.roles_named()
    if not named:
        return None
    from . import roles as _r

    if named <= {"lm_head"}:
        return {n: frozenset({"lm_head"}) for n in _r.lm_heads(model)}
    found = getattr(model, "fp4train_roles", None)
    if found is None:
        found = _r.linear_roles(model)
        model.fp4train_roles = found
        if found.how == "names":
            warnings.warn(f"recipe {recipe.name!r} gives attention's projections ({', '.join(sorted(named - {'lm_head'}))}) "
                          f"their own numerics, and fp4train could not trace them through {type(model).__name__}: "
                          f"{found.why}; they are matched by their usual names instead (q_proj, k_proj, query, key, ...)",
                          UserWarning, stacklevel=3)
    return found
