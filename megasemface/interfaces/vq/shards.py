"""A flat VQ layer's state split over model-parallel ranks and gathered back, for the
checkpoint tools: pure tensor functions over the keys of
:data:`SPLIT_PARAMETERS`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "SPLIT_PARAMETERS",
    "gather_codebook",
    "gather_state_dicts",
    "shard_state_dict",
    "split_codebook",
]

SPLIT_PARAMETERS: tuple[str, ...] = ("logits_weight", "logits_bias", "codebook")
"""State-dict keys of a flat layer that are split along dim 0 across model-parallel ranks."""


def split_codebook(full: Tensor, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s contiguous shard (dim 0) of a flat-layer tensor split ``size`` ways."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid rank {rank} of size {size}")
    if full.shape[0] % size:
        raise ValueError(f"{full.shape[0]} rows are not divisible by {size} shards")
    rows = full.shape[0] // size
    return full[rank * rows : (rank + 1) * rows].clone()


def gather_codebook(shards: Sequence[Tensor]) -> Tensor:
    """The full tensor from shards listed in model-parallel rank order."""
    if not shards:
        raise ValueError("no shards")
    return torch.cat(list(shards), dim=0)


def shard_state_dict(full: Mapping[str, Tensor], rank: int, size: int) -> dict[str, Tensor]:
    """A flat layer's full state dict cut to rank ``rank``'s shard (other keys copied)."""
    return {
        key: split_codebook(value, rank, size) if key in SPLIT_PARAMETERS else value
        for key, value in full.items()
    }


def gather_state_dicts(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The full state dict from the ranks' state dicts (replicated keys from rank 0)."""
    if not shards:
        raise ValueError("no shards")
    return {
        key: gather_codebook([s[key] for s in shards]) if key in SPLIT_PARAMETERS else value
        for key, value in shards[0].items()
    }
