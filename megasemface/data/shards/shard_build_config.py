"""The options of a shard build, its error, and the token id type a vocabulary needs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["ShardBuildConfig", "ShardBuildError", "id_dtype_for"]


@dataclasses.dataclass(kw_only=True)
class ShardBuildConfig:
    """Options of a shard build; all of them are part of the build's fingerprint."""

    max_chars: int = 2000
    """Lines with more characters than this (after white-space cleaning) are dropped."""
    max_tokens: int = 254
    """Sentences with more tokens are dropped (the paper's length limit 256, less 2 specials);
    pairs with more on either side (so a stored pair has at most 2 x max_tokens + 1)."""
    dedup: bool = False
    """Drop exact duplicate lines (pairs) within a language (pair); 16-32 bytes per distinct
    one."""
    tokens_per_sample: int = 1 << 16
    """A sample closes once it holds this many tokens (about 128 KiB of uint16 ids)."""
    samples_per_shard: int = 256
    """Samples per shard file (about 16M tokens, 32 MiB, per shard by default)."""
    jobs: int = 1
    """Worker processes that clean and encode; 1 works in the main process."""
    bytes_per_task: int = 1 << 18
    """Raw text sent to a worker at a time (cut at line ends)."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_tokens", "tokens_per_sample", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.jobs < 1 or self.bytes_per_task < 1:
            raise ValueError("jobs and bytes_per_task must be >= 1")

    def output_fields(self) -> dict[str, Any]:
        """The options that decide the output bytes (jobs and task size do not)."""
        fields = dataclasses.asdict(self)
        del fields["jobs"], fields["bytes_per_task"]
        return fields


class ShardBuildError(RuntimeError):
    """A shard build cannot proceed; the message says why and what to do."""


def id_dtype_for(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 token ids when the vocabulary allows, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32
