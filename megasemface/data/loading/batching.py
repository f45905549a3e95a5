"""Token-budget batching: many short sentences or few long ones, little padding.

Sentences of one shard sample (thousands of them) are sorted by length, with a seeded
random tie-break, and cut greedily into batches whose padded size (sentences x longest)
stays within the token budget. Because neighbours in length order have nearly the same
length, padding stays small (the loader reports the real-token fraction), and because the
batches of a sample are then shuffled, consecutive batches still vary in length.

The loader batches a :class:`Pool` at a time: consecutive shard samples merged until they
hold enough tokens for length grouping to work.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megasemface.data.shards.shard_format import Chunk

__all__ = ["Pool", "token_budget_batches"]


def token_budget_batches(
    lengths: np.ndarray, max_tokens: int, rng: np.random.Generator, max_sentences: int = 0
) -> list[np.ndarray]:
    """Groups sentence indices into shuffled batches with ``count * longest <= max_tokens``.

    Args:
        lengths: the length of each sentence, already cropped to at most ``max_tokens``.
        max_tokens: the budget of a batch, padding included.
        rng: decides tie-breaks and batch order, so the result is reproducible.
        max_sentences: an optional cap on sentences per batch (0: none).
    """
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return []
    if int(lengths.max()) > max_tokens:
        raise ValueError(
            f"a sentence of {int(lengths.max())} tokens exceeds max_tokens={max_tokens}"
        )
    order = np.lexsort((rng.random(len(lengths)), lengths))
    sorted_lengths = np.maximum(lengths[order], 1)
    cap = max_sentences if max_sentences > 0 else len(lengths)
    batches = []
    start = 0
    while start < len(order):
        window = sorted_lengths[start : start + cap]
        padded = np.arange(1, len(window) + 1) * window
        over = np.flatnonzero(padded > max_tokens)
        count = int(over[0]) if len(over) else len(window)
        batches.append(order[start : start + count])
        start += count
    return [batches[i] for i in rng.permutation(len(batches))]


@dataclasses.dataclass
class Pool:
    """Consecutive samples of a slot's shard sequence (possibly several shards), merged."""

    key: tuple[int, int]  # where it starts: (shard position k, sample in that shard)
    next_key: tuple[int, int]  # where the next pool starts
    tokens: np.ndarray
    offsets: np.ndarray  # start of each sentence in tokens
    lengths: np.ndarray  # cropped lengths
    sentence_ids: np.ndarray  # (language << 56) | (shard index << 32) | sentence in shard
    epochs: np.ndarray  # the epoch each sentence was read in
    batches: list[np.ndarray]

    @classmethod
    def merge(
        cls,
        key: tuple[int, int],
        next_key: tuple[int, int],
        chunks: list[tuple[Chunk, int, int]],
        lang_index: int,
        max_len: int,
    ) -> Pool:
        """Merges (chunk, epoch, shard index) triples; batches are filled in by the caller."""
        if not chunks:
            empty = np.zeros(0, dtype=np.int64)
            return cls(key, next_key, empty, empty, empty, empty, empty, [])
        sizes = np.cumsum([0] + [len(c.tokens) for c, _, _ in chunks[:-1]])
        prefix = [(lang_index << 56) | (index << 32) for _, _, index in chunks]
        return cls(
            key=key,
            next_key=next_key,
            tokens=np.concatenate([c.tokens for c, _, _ in chunks]),
            offsets=np.concatenate(
                [c.offsets[:-1] + base for (c, _, _), base in zip(chunks, sizes, strict=True)]
            ),
            lengths=np.minimum(np.concatenate([c.lengths for c, _, _ in chunks]), max_len),
            sentence_ids=np.concatenate(
                [
                    high | (c.first_sentence + np.arange(c.num_sentences, dtype=np.int64))
                    for (c, _, _), high in zip(chunks, prefix, strict=True)
                ]
            ),
            epochs=np.concatenate(
                [np.full(c.num_sentences, epoch, dtype=np.int64) for c, epoch, _ in chunks]
            ),
            batches=[],
        )
