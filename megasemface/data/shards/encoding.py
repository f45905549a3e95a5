"""The worker side of shard building: clean, hash and encode a block of raw lines; and
:class:`EncodingPool`, which runs that in order, inline or in worker processes.

Kept apart from the builder so that worker processes import only numpy, SentencePiece and
the cleaning rules.

A block has one side per aligned file: one for a language's corpus, two (source, target)
for a parallel corpus, whose pairs are encoded as one sequence ``source ids + [separator] +
target ids`` (see ``megasemface.data.loading.pairs``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import multiprocessing as mp
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import sentencepiece as spm

from megasemface.data.text.cleaning import clean_aligned, line_hash

__all__ = ["EncodedBlock", "EncodingPool", "init_worker", "process_block"]

_PROCESSOR: spm.SentencePieceProcessor | None = None


def init_worker(model_proto: bytes) -> None:
    """Loads the SentencePiece model once per worker process."""
    global _PROCESSOR
    _PROCESSOR = spm.SentencePieceProcessor(model_proto=model_proto)


@dataclasses.dataclass
class EncodedBlock:
    """What a worker returns for a block of lines (or of aligned pairs of lines)."""

    statuses: np.ndarray
    """uint8 DropReason per line (KEPT: passed the text filters on every side)."""
    kept: np.ndarray
    """int64 positions of the lines that passed the text filters."""
    hashes: np.ndarray | None
    """uint64 hash per kept line (of both sides of a pair), when de-duplicating."""
    tokens: np.ndarray | None
    """The ids of the kept lines (or joined pairs), concatenated, when encoding."""
    lengths: np.ndarray | None
    """int64 token count per kept line (a pair's: both sides and the separator)."""
    longest_side: np.ndarray | None
    """int64 tokens of each kept line's longest side, which ``max_tokens`` limits."""


def process_block(
    sides: tuple[bytes | list[bytes], ...],
    max_chars: int,
    dedup: bool,
    encode: bool,
    dtype: str,
    separator: int,
) -> EncodedBlock:
    """Cleans every line, hashes the kept ones (dedup) and encodes them (encode).

    ``sides`` holds one side (a language) or two (a pair's source and target), each raw
    text cut at line ends (split here, in the worker) or a list of lines; the sides hold the
    same lines of aligned files. A kept pair is encoded as source ids, ``separator``, target
    ids.
    """
    statuses, kept, texts = clean_aligned(sides, max_chars)
    hashes = None
    if dedup:
        # Cleaned text never holds a line end, so joining the sides with one is unambiguous.
        joined = texts[0] if len(texts) == 1 else map("\n".join, zip(*texts, strict=True))
        hashes = np.fromiter(map(line_hash, joined), np.uint64, len(kept))
    tokens = lengths = longest = None
    if encode:
        assert _PROCESSOR is not None, "init_worker was not called"
        # One thread: parallelism comes from worker processes, not oversubscribed threads.
        ids = [_PROCESSOR.encode(side, out_type=int, num_threads=1) for side in texts]
        side_lengths = [np.fromiter(map(len, side), np.int64, len(kept)) for side in ids]
        pieces: Iterable[list[int]]
        if len(ids) == 1:
            pieces = ids[0]
            lengths = longest = side_lengths[0]
        else:
            src, tgt = ids  # a pair: source ids, the separator, target ids
            sep = [separator]
            pieces = (part for s, t in zip(src, tgt, strict=True) for part in (s, sep, t))
            lengths = side_lengths[0] + side_lengths[1] + 1
            longest = np.maximum(side_lengths[0], side_lengths[1])
        tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype, int(lengths.sum()))
    return EncodedBlock(statuses, kept, hashes, tokens, lengths, longest)


class EncodingPool:
    """Runs process_block in order, inline or on a pool with a bounded number in flight."""

    def __init__(self, jobs: int, model_proto: bytes) -> None:
        self._pool = None
        if jobs > 1:
            # fork starts workers in milliseconds; spawn would re-import torch (through
            # webdataset) in each worker. The pool is made before any thread is started.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            self._pool = ctx.Pool(jobs, initializer=init_worker, initargs=(model_proto,))
        else:
            init_worker(model_proto)
        self._in_flight = 2 * jobs

    def map(self, blocks: Iterable[tuple[Any, ...]]) -> Iterator[EncodedBlock]:
        """process_block over argument tuples, results in order."""
        if self._pool is None:
            for args in blocks:
                yield process_block(*args)
            return
        pending: collections.deque[Any] = collections.deque()
        for args in blocks:
            pending.append(self._pool.apply_async(process_block, args))
            if len(pending) >= self._in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
