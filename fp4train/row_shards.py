"""Tensors split by rows over processes: FSDP2's ``DTensor`` parameters (``Shard(0)`` on a one-dimensional mesh), their
optimizer states, and whole-matrix work on them.

The optimizers update a parameter's local rows with its gradient's local rows and keep its states as ``DTensor``
too, so that ``torch.distributed.checkpoint`` saves each process's part and gathers or reshards them like the
parameter:

* an elementwise FP32 state is sharded exactly like its parameter;
* an NVFP4 state (:mod:`fp4train.optim.state_codec`) is encoded shard by shard - its 1x16 blocks lie within a row
  and its 16x16 tiles within a shard when each process holds a whole number of tiles' rows (:func:`check`) - with
  the whole tensor's scale (:func:`amax_over`, an all-reduce of the shards' amax), so that its codes, block scales
  and tile means are the rows of one process's, sharded by rows, and its tensor scale is replicated.

Whole-matrix work (Muon's Newton-Schulz, LoRA-SVD's realignment) gathers the matrix (:func:`whole`, :func:`full`),
is computed alike on every process, and each keeps its own rows of the result (:func:`own_rows`, :func:`assign`).
"""

from __future__ import annotations

import torch


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, _dtensor())


def local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local part (the tensor itself otherwise): in-place updates of it update the ``DTensor``."""
    return t.to_local() if is_sharded(t) else t


def check(p: torch.Tensor, name: str, *, tiles: int | None) -> None:
    """Refuse a sharded parameter whose states cannot be kept sharded: not split by rows on a one-dimensional mesh,
    or - ``tiles``: its states are stored in ``tiles`` x ``tiles`` tiles - whose rows do not split into whole tiles
    over the processes."""
    from torch.distributed.tensor import Shard

    if not is_sharded(p):
        return
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"{name}: the optimizer keeps the states of parameters sharded by rows on one mesh dimension "
                         f"(FSDP2's fully_shard), got placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh")
    if tiles is None:
        return
    world, rows = p.device_mesh.size(), p.shape[0]
    rest = 1  # the states' rows are the parameter's leading dims flattened; each process holds rows/world of dim 0
    for d in p.shape[1:-1]:
        rest *= d
    if rows % world or (rows // world * rest) % tiles:
        raise ValueError(f"{name}: a parameter of shape {tuple(p.shape)} does not split into whole {tiles}-row tiles of "
                         f"NVFP4 optimizer states over {world} processes (each needs a multiple of {tiles} rows): use "
                         "--parallel ddp, another number of processes, or --optimizer adamw")


def like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` - this process's part of a state shaped and sharded like ``p`` - as such a ``DTensor`` (``t`` itself if
    ``p`` is not sharded)."""
    if not is_sharded(p):
        return t
    return _dtensor().from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def by_rows(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` - this process's rows of a state stored per row block of ``p`` (:func:`check` makes the split even) -
    as a ``DTensor`` sharded by rows; a 0-d ``t`` (a tensor scale, the same on every process) replicated."""
    from torch.distributed.tensor import Replicate, Shard

    if not is_sharded(p):
        return t
    if t.ndim == 0:
        return _dtensor().from_local(t, p.device_mesh, [Replicate()], run_check=False)
    shape = (t.shape[0] * p.device_mesh.size(), *t.shape[1:])
    return _dtensor().from_local(t, p.device_mesh, [Shard(0)], run_check=False, shape=shape,
                                 stride=torch.empty(shape, device="meta").stride())


def amax_over(p: torch.Tensor):
    """For a sharded ``p``: the function taking a shard's amax to the whole tensor's (an all-reduce over ``p``'s
    processes); ``None`` otherwise."""
    if not is_sharded(p):
        return None
    import torch.distributed as dist

    group = p.device_mesh.get_group()

    def whole_amax(amax: torch.Tensor) -> torch.Tensor:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return whole_amax


def element_offset(p: torch.Tensor) -> int:
    """The flat index, in the whole tensor, of this process's first element of ``p`` (0 if ``p`` is not sharded):
    the shards split the rows evenly (:func:`check`), so it is the process's rank times its number of elements."""
    if not is_sharded(p):
        return 0
    return p.device_mesh.get_local_rank() * local(p).numel()


def whole(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``t`` is this process's part, sharded like ``p`` (an all-gather)."""
    return like(t, p).full_tensor() if is_sharded(p) else t


def full(p: torch.Tensor) -> torch.Tensor:
    """``p`` whole (gathered if it is a ``DTensor``)."""
    return p.full_tensor() if is_sharded(p) else p


def assign(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p <- value`` (a whole tensor shaped like ``p``), in place: a sharded ``p`` keeps its own rows of it."""
    local(p).copy_(own_rows(value, p))


def own_rows(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``, a whole tensor shaped like ``p``, as ``p`` is sharded."""
    if not is_sharded(p):
        return t
    from torch.distributed.tensor import Replicate

    return _dtensor().from_local(t, p.device_mesh, [Replicate()], run_check=False).redistribute(
        p.device_mesh, p.placements).to_local()
