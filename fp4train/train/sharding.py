"""Fully sharded data parallel (``--parallel fsdp``): PyTorch's FSDP2 (``fully_shard``) per transformer block.

Each block's parameters, gradients and optimizer states (AdamW's, or QAdamW's and QMuon's NVFP4 ones:
:mod:`fp4train.row_shards`) are split over the processes (dim 0, as ``torch.distributed.DTensor`` shards); before a block runs, FSDP2 all-gathers its weights, so a quantized linear
quantizes the whole gathered weight (its block and tensor scales are the whole weight's, as in one process), and
after the backward it reduce-scatters the gradients (their mean over the processes). Mixed precision: on a GPU
the weights are all-gathered in BF16 and gradients reduced in FP32 - the quantizers then read weights rounded to
BF16, where one process quantizes the FP32 master weights directly (a second rounding, small next to FP4's);
on a CPU nothing is cast, and the arithmetic is one process's but for the gradients' summation order. Weights
are not all-gathered in FP8 or MXFP4: that would quantize every weight twice (for the wire, then for the GEMM)
to save half or three quarters of the all-gather's bytes.

A sharded run checkpoints through ``torch.distributed.checkpoint``: :func:`sharded_state` gives each process's
shards of the model and optimizer state (keyed by parameter name), which every process writes itself; any run -
sharded or not, on any number of processes - reads them back with :func:`load_sharded_state`, Distributed
Checkpoint resharding them to its own layout. A single-process checkpoint loads into a sharded run through
:func:`load_full_state` (every rank keeps its shard of the whole tensors).
"""

from __future__ import annotations

import torch
from torch import nn


def shard(model: nn.Module, device_type: str) -> None:
    """``fully_shard`` every transformer block of ``model`` (``model.layers``) and then the rest (embedding, final
    norm, LM head: tied weights stay one parameter)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device_type == "cuda" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def _ids_to_names(opt: torch.optim.Optimizer, model: nn.Module, osd: dict) -> dict:
    """A single-process optimizer state dict (state keyed by parameter number) keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {"state": {order[i]: st for i, st in osd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, msd: dict, osd: dict) -> None:
    """Load a single-process checkpoint's model and optimizer state into the sharded ``model`` and its ``opt``
    (every rank holds the whole checkpoint and keeps its own shard of it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from ..linear.lora_svd import residual_form

    set_model_state_dict(model, residual_form(msd), options=StateDictOptions(full_state_dict=True))
    _load_optimizer(model, opt, _ids_to_names(opt, model, osd), full=True)


def _load_optimizer(model: nn.Module, opt: torch.optim.Optimizer, by_name: dict, *, full: bool) -> None:
    """``by_name`` (state and param groups keyed by parameter name; whole tensors if ``full``, else this rank's
    shards) into ``opt``. Not strict: a parameter without state in it had none (LoRA-SVD's factors right after a
    realignment) and is left with none."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=full, strict=False))
    names = {id(p): n for n, p in model.named_parameters()}
    for p in [p for p in opt.state if names.get(id(p)) not in by_name["state"]]:
        del opt.state[p]


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, list]:
    """(``{"model": ..., "optimizer": ...}``: the model's and the optimizer's state tensors, sharded ones as
    ``DTensor`` and keyed by parameter name - what ``torch.distributed.checkpoint.save`` writes; the optimizer's
    param groups, plain data)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..linear.lora_svd import residual_state_dicts

    with residual_state_dicts(model):
        msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd["state"]}, osd["param_groups"]


def load_sharded_state(model: nn.Module, opt: torch.optim.Optimizer, path, param_groups: list) -> None:
    """A sharded checkpoint (the directory ``path``, :func:`sharded_state`'s tensors) into ``model`` and ``opt``,
    sharded or not: each process reads the parts of the tensors it holds."""
    from ..linear.lora_svd import residual_state_dicts

    with residual_state_dicts(model):
        _load_sharded_state(model, opt, path, param_groups)


def _load_sharded_state(model, opt, path, param_groups) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

    from ..checkpoint import sharded_entries, single_process_ok

    msd, osd = get_state_dict(model, opt)  # the optimizer's state made (a zero step at lr 0) to be read into
    saved = sharded_entries(path)
    ostate = {}
    for name, st in osd["state"].items():
        kept = {k: v for k, v in st.items() if f"optimizer.{name}.{k}" in saved}
        if kept:
            ostate[name] = kept
    state = {"model": msd, "optimizer": ostate}
    with single_process_ok():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    _load_optimizer(model, opt, {"state": state["optimizer"], "param_groups": param_groups}, full=False)


def state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """``opt``'s state keyed by parameter name: what survives :func:`shard` replacing the parameters."""
    return _ids_to_names(opt, model, opt.state_dict())


def load_state_by_name(model: nn.Module, opt: torch.optim.Optimizer, by_name: dict) -> None:
    """:func:`state_by_name`'s state into ``opt`` over the sharded ``model``: each rank keeps its shard."""
    _load_optimizer(model, opt, by_name, full=True)


def average_gradients(model: nn.Module, world: int) -> None:
    """The mean gradient over the processes, in place (the unsharded model of AdaHOP's calibration steps)."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
