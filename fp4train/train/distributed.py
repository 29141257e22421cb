"""Data-parallel training on PyTorch's own engine: ``torchrun`` launches the processes, ``torch.distributed``
(NCCL on GPUs, gloo on CPUs) connects them, ``DistributedDataParallel`` averages the gradients.

Every process holds the whole model and the same optimizer state; each takes ``batch_size / N`` of every
global batch's sequences (:class:`~fp4train.data.PackedBatches` with ``rank``/``world``), so the global batch,
its order and the data position are the same whatever N - and a checkpoint, written by rank 0 in the
single-process format, resumes on any number of processes. Gradients are averaged over equal shards: the
mean over ranks of each rank's mean loss is the global batch's mean loss, as one process computes it. AdaHOP's
calibration is rank 0's, sent to every rank, so all ranks run the same strategies.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over the processes (on ``t``'s device: no host round trip of its own)."""
        if self.world == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)  # a sum: gloo has no average
        return t / self.world

    def max(self, value: int) -> int:
        """The largest of the processes' ``value`` s."""
        if self.world == 1:
            return value
        t = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup(parallel: str, batch_size: int, device_type: str) -> Ranks:
    """The process's place in the run; joins the process group under ``torchrun`` with ``--parallel ddp|fsdp``.
    Refuses a launch that cannot be what the user meant, naming the fix (``parallel`` is a checked config value)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "none":
        if world > 1:
            raise ValueError(f"launched as {world} processes (torchrun) but --parallel is none: add --parallel ddp "
                             "(or fsdp), or run one process")
        return Ranks()
    if "RANK" not in os.environ:
        raise ValueError(f"--parallel {parallel} runs under torchrun: torchrun --nproc-per-node N -m fp4train train "
                         f"--parallel {parallel} ...")
    if batch_size % world:
        raise ValueError(f"--batch-size {batch_size} does not split over {world} processes: give a multiple of {world} "
                         "(the global batch stays the same whatever the number of processes)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = Ranks(int(os.environ["RANK"]), world, local)
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return ranks


def leave() -> None:
    """After a finished run under torchrun: free what is only garbage now (tensors a collective's work may still
    hold, which destroyed during the interpreter's shutdown abort the process), wait for every process, then leave
    the process group."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
