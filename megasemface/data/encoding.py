"""The worker side of shard building: clean, hash and encode a block of raw lines.

Kept apart from the builder so that worker processes import only numpy, SentencePiece and
the cleaning rules.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import sentencepiece as spm

from megasemface.data.cleaning import clean_block, clean_lines, line_hash

__all__ = ["EncodedBlock", "init_worker", "process_block"]

_PROCESSOR: spm.SentencePieceProcessor | None = None


def init_worker(model_proto: bytes) -> None:
    """Loads the SentencePiece model once per worker process."""
    global _PROCESSOR
    _PROCESSOR = spm.SentencePieceProcessor(model_proto=model_proto)


@dataclasses.dataclass
class EncodedBlock:
    """What a worker returns for a block of lines."""

    statuses: np.ndarray
    """uint8 DropReason per line (KEPT: passed the text filters)."""
    kept: np.ndarray
    """int64 positions of the lines that passed the text filters."""
    hashes: np.ndarray | None
    """uint64 hash per kept line, when de-duplicating."""
    tokens: np.ndarray | None
    """The ids of the kept lines, concatenated, when encoding."""
    lengths: np.ndarray | None
    """int64 token count per kept line, when encoding."""


def process_block(
    block: bytes | list[bytes], max_chars: int, dedup: bool, encode: bool, dtype: str
) -> EncodedBlock:
    """Cleans every line, hashes the kept ones (dedup) and encodes them (encode).

    ``block`` is raw text cut at line ends (split here, in the worker) or a list of lines.
    """
    clean = clean_block if isinstance(block, bytes) else clean_lines
    statuses, kept, texts = clean(block, max_chars)  # type: ignore[arg-type]
    hashes = np.fromiter(map(line_hash, texts), np.uint64, len(texts)) if dedup else None
    tokens = lengths = None
    if encode:
        assert _PROCESSOR is not None, "init_worker was not called"
        # One thread: parallelism comes from worker processes, not oversubscribed threads.
        ids = _PROCESSOR.encode(texts, out_type=int, num_threads=1)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))
    return EncodedBlock(statuses, kept, hashes, tokens, lengths)
