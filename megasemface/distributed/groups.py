"""Model- and data-parallel process groups, DeepSpeed's ``mpu`` adapter and autograd collectives.

Layout (Megatron's convention): the world of ``dp_size x mp_size`` ranks is cut into
model-parallel (mp) groups of *consecutive* ranks, ``rank = dp_rank * mp_size + mp_rank``; ranks
that share an ``mp_rank`` form a data-parallel (dp) group. Every rank of one mp group sees the same
tokens and holds a different shard of the split weights (the flat VQ codebook); every dp group
sees different tokens and holds the same weights, which DeepSpeed's ZeRO shards and averages.

A :class:`ParallelGroups` value is handed to every layer that communicates: model code never reads
a global "current group" and never imports DeepSpeed. :func:`ParallelGroups.single` is the
one-process value, for which every helper below is a no-op that does not touch
``torch.distributed`` at all (it need not be initialised).

The autograd collectives follow Megatron's ``mappings.py`` pattern:

* :func:`copy_to_model_parallel` marks where a replicated activation enters the split region: its
  forward is the identity, its backward sums the partial input gradients of the mp ranks.
* :func:`reduce_from_model_parallel` marks where it leaves: forward sums the partial results,
  backward is the identity because every mp rank then computes the same downstream loss.
* :func:`global_batch_sum` sums a statistic over the dp group for a loss defined on the *global*
  batch (the VQ diversity loss); its backward scales by ``dp_size`` so that the data-parallel
  gradient *averaging* that DeepSpeed applies afterwards yields the exact global gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DeepSpeedMpu",
    "ParallelGroups",
    "ReduceOpName",
    "all_reduce_data_parallel",
    "all_reduce_model_parallel",
    "build_parallel_groups",
    "copy_to_model_parallel",
    "global_batch_sum",
    "mark_model_parallel_parameter",
    "reduce_from_model_parallel",
]

ReduceOpName = Literal["sum", "max", "min"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's model-parallel and data-parallel groups.

    ``mp_group``/``dp_group`` are ``torch.distributed`` process groups, or None in the
    single-process value. ``mp_ranks``/``dp_ranks`` are the *global* ranks of the members, in
    group-rank order (``mp_ranks[mp_rank]`` is this process).
    """

    mp_group: Any
    dp_group: Any
    mp_rank: int
    mp_size: int
    dp_rank: int
    dp_size: int
    mp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for name in ("mp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"invalid {name} rank {rank} of size {size}")
            if len(getattr(self, f"{name}_ranks")) != size:
                raise ValueError(f"{name}_ranks must list {size} global ranks")

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process: no model or data parallelism, and no communication at all."""
        return cls(mp_group=None, dp_group=None, mp_rank=0, mp_size=1, dp_rank=0, dp_size=1)

    @property
    def is_single(self) -> bool:
        return self.mp_size == 1 and self.dp_size == 1


def build_parallel_groups(mp_size: int) -> ParallelGroups:
    """This rank's groups in an initialised ``torch.distributed`` world of ``dp x mp`` ranks.

    Every rank must call this collectively, with the same ``mp_size``: ``new_group`` is itself a
    collective that every process enters for every group, in the same order. Groups of size 1 are
    still created, because DeepSpeed passes them to collectives, where None would mean "world".
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_parallel_groups needs an initialised torch.distributed")
    world, rank = dist.get_world_size(), dist.get_rank()
    if mp_size < 1 or world % mp_size:
        raise ValueError(f"world size {world} is not divisible by model-parallel size {mp_size}")
    dp_size = world // mp_size
    mp_group = dp_group = None
    mp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    for dp_index in range(dp_size):
        ranks = tuple(range(dp_index * mp_size, (dp_index + 1) * mp_size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mp_group, mp_ranks = group, ranks
    for mp_index in range(mp_size):
        ranks = tuple(range(mp_index, world, mp_size))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            dp_group, dp_ranks = group, ranks
    return ParallelGroups(
        mp_group=mp_group,
        dp_group=dp_group,
        mp_rank=rank % mp_size,
        mp_size=mp_size,
        dp_rank=rank // mp_size,
        dp_size=dp_size,
        mp_ranks=mp_ranks,
        dp_ranks=dp_ranks,
    )


class DeepSpeedMpu:
    """The ``mpu`` object of ``deepspeed.initialize(mpu=...)``, answering from ParallelGroups.

    With it DeepSpeed 0.19 shards ZeRO state and averages gradients over the data-parallel group
    only, sums gradient norms over the model-parallel group (counting replicated parameters once,
    on mp rank 0, and parameters marked by :func:`mark_model_parallel_parameter` on every rank),
    and names checkpoint files by model-parallel rank. The methods are those DeepSpeed calls:
    the Megatron names ``get_{model,data}_parallel_*``, the newer ``get_tensor_model_parallel_*``
    (preferred by ``deepspeed.utils.bwc``) and the pipeline queries of its checkpoint metadata
    (no pipeline parallelism here: size 1). It deliberately lacks ``initialize_sequence_parallel``,
    whose mere presence makes DeepSpeed treat the object as a sequence-parallel (Ulysses) unit.
    """

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups

    # Megatron's original names.
    def get_model_parallel_rank(self) -> int:
        return self.groups.mp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.mp_size

    def get_model_parallel_group(self) -> Any:
        return self.groups.mp_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size

    def get_data_parallel_group(self) -> Any:
        return self.groups.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.dp_ranks)

    # Tensor-parallel names (Megatron after pipeline parallelism); same group here.
    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.mp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.mp_size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.groups.mp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of mp rank 0 of this group (broadcast source)."""
        return self.groups.mp_ranks[0]

    # No pipeline parallelism.
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def mark_model_parallel_parameter(param: torch.nn.Parameter, partition_dim: int = 0) -> None:
    """Tags a parameter split across the model-parallel group (Megatron's attribute names).

    DeepSpeed's gradient-norm and clipping code counts a parameter on every mp rank only when
    ``tensor_model_parallel`` is set; untagged (replicated) parameters count on mp rank 0 only.
    ``partition_dim`` tells checkpoint tools along which dimension shards are concatenated.
    """
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


def _all_reduce(tensor: Tensor, group: Any, size: int, op: ReduceOpName) -> Tensor:
    if size == 1:
        return tensor
    if tensor.is_contiguous():
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    else:
        # Backends reduce the underlying storage: a strided view would be reduced wrongly.
        buffer = tensor.contiguous()
        dist.all_reduce(buffer, op=_OPS[op], group=group)
        tensor.copy_(buffer)
    return tensor


def all_reduce_model_parallel(
    tensor: Tensor, groups: ParallelGroups, op: ReduceOpName = "sum"
) -> Tensor:
    """In-place all-reduce over the model-parallel group (no autograd); returns ``tensor``."""
    return _all_reduce(tensor, groups.mp_group, groups.mp_size, op)


def all_reduce_data_parallel(
    tensor: Tensor, groups: ParallelGroups, op: ReduceOpName = "sum"
) -> Tensor:
    """In-place all-reduce over the data-parallel group (no autograd); returns ``tensor``."""
    return _all_reduce(tensor, groups.dp_group, groups.dp_size, op)


class _CopyToModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: ParallelGroups) -> Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Clone: the incoming gradient buffer may be shared with other graph branches.
        return all_reduce_model_parallel(grad.contiguous().clone(), ctx.groups), None


class _ReduceFromModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: ParallelGroups) -> Tensor:
        return all_reduce_model_parallel(x.contiguous().clone(), groups)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GlobalBatchSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: ParallelGroups) -> Tensor:
        ctx.dp_size = groups.dp_size
        return all_reduce_data_parallel(x.contiguous().clone(), groups)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.dp_size, None


def copy_to_model_parallel(x: Tensor, groups: ParallelGroups) -> Tensor:
    """Identity forward; backward all-reduces (SUM) the gradient over the mp group."""
    if groups.mp_size == 1:
        return x
    return _CopyToModelParallel.apply(x, groups)


def reduce_from_model_parallel(x: Tensor, groups: ParallelGroups) -> Tensor:
    """All-reduce (SUM) over the mp group forward; identity backward."""
    if groups.mp_size == 1:
        return x
    return _ReduceFromModelParallel.apply(x, groups)


def global_batch_sum(x: Tensor, groups: ParallelGroups) -> Tensor:
    """Sums ``x`` over the data-parallel group, for a loss defined on the global batch.

    Every dp rank then computes the same loss value L(global). Its true gradient is the *sum*
    over ranks of each rank's local contribution dL/dx_r * dx_r/dtheta, but DeepSpeed *averages*
    gradients over dp; the backward therefore multiplies by ``dp_size`` so that the average is
    exactly the global gradient (the same as one process seeing the concatenated batch).
    """
    if groups.dp_size == 1:
        return x
    return _GlobalBatchSum.apply(x, groups)
