"""Token-budget batching: many short sentences or few long ones, little padding.

Sentences of one shard sample (thousands of them) are sorted by length, with a seeded
random tie-break, and cut greedily into batches whose padded size (sentences x longest)
stays within the token budget. Because neighbours in length order have nearly the same
length, padding stays small (the loader reports the real-token fraction), and because the
batches of a sample are then shuffled, consecutive batches still vary in length.
"""

from __future__ import annotations

import numpy as np

__all__ = ["token_budget_batches"]


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
