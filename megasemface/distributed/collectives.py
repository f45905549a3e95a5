"""Collectives over every rank of the run, for the training loop's bookkeeping.

The loop agrees on things all ranks must decide alike (skip a step with a non-finite loss,
stop on a signal, keep generating while any rank has unfinished sentences) and sums counters
for its logs. These go over the whole world, unlike the model-parallel and data-parallel
collectives of :mod:`megasemface.distributed.groups`, which live inside the model's
arithmetic. In a one-process run (``torch.distributed`` not started, or a world of one)
every function here is the identity and touches nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "RankSharedError",
    "all_gather_objects",
    "all_reduce_",
    "any_rank",
    "barrier",
    "collective_device",
    "raise_if_any_rank",
    "rank",
    "sum_or_max",
    "world_size",
]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _multi_process() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes of the run (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where the run's collectives take their tensors: the current CUDA device when the
    process group is NCCL alone (it reduces device tensors only), else the host (gloo)."""
    if _multi_process() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_or_max(values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
    """``values`` reduced element-wise over every rank, in float64 (exact for counters).
    Read back on the host: a synchronisation wherever the collective runs on a device."""
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if _multi_process():
        dist.all_reduce(tensor, op=_OPS[op])
    return tensor.tolist()


def all_reduce_(tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """``tensor`` reduced element-wise over every rank in place, where it lives (nothing is
    read back: on a GPU the reduction is queued behind the work that makes the tensor)."""
    if _multi_process():
        dist.all_reduce(tensor, op=_OPS[op])
    return tensor


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    if not _multi_process():
        return flag
    return sum_or_max([1.0 if flag else 0.0], "max")[0] > 0


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-like values), in rank order."""
    if not _multi_process():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class RankSharedError(ValueError):
    """A problem every rank stops on together; ``quiet`` on the ranks that leave reporting
    it to rank 0, so that a run prints it once."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def raise_if_any_rank(problem: str | None, error: type[RankSharedError] = RankSharedError) -> None:
    """Raises ``error`` on every rank with the first rank's problem when any rank has one: a
    rank that stopped alone would keep the others waiting in their next collective."""
    found = [p for p in all_gather_objects(problem) if p is not None]
    if found:
        raise error(found[0], quiet=rank() != 0)


def barrier() -> None:
    """Waits until every rank has arrived."""
    if dist.is_initialized():
        dist.barrier()
