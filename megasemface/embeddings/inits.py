"""The mapping's initial dictionaries from the two monolingual spaces alone, by name.

``CLEmbeddingConfig.init`` names one of :data:`INITS`; each gives (source id, target id) pairs
of the joint vocabulary:

- ``identical``: every id both languages use at least the seed floor times (VecMap's
  ``--init_identical``: in a joint vocabulary an identical string is the same id, so this
  holds the shared words, the numerals and digit pieces, the punctuation and the shared
  word fragments);
- ``numerals``: only the shared ids whose piece holds a digit (VecMap's ``--init_numerals``:
  fewer pairs, but none a false friend such as English "die" and German "die");
- ``unsupervised``: VecMap's similarity-distribution initialisation, no shared string needed.

A seed dictionary given from outside (parallel sentences or a word list) is added to these
pairs (:mod:`megasemface.embeddings.seeds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from megasemface.embeddings.mapping import unsupervised_seed

__all__ = ["INITS", "InitInputs", "digit_pieces"]


@dataclasses.dataclass(frozen=True)
class InitInputs:
    """What an initialisation may read, for the mapping of one language onto the pivot."""

    x: torch.Tensor
    """The source language's normalised [V, d] space."""
    z: torch.Tensor
    """The pivot's."""
    x_rows: np.ndarray
    """Source ids taking part in dictionary induction, most frequent first."""
    z_rows: np.ndarray
    shared: np.ndarray
    """Ids of both induction rows that both languages use at least the seed floor times."""
    digits: np.ndarray
    """[V] bool: the id's piece holds a digit."""
    init_vocab: int
    csls_k: int
    block_size: int


def digit_pieces(pieces: list[str]) -> np.ndarray:
    """[V] bool: which pieces hold a digit (numerals, and parts of them)."""
    return np.array([any(c.isdigit() for c in piece) for piece in pieces], dtype=bool)


def _identical(inputs: InitInputs) -> np.ndarray:
    return np.stack([inputs.shared, inputs.shared], 1)


def _numerals(inputs: InitInputs) -> np.ndarray:
    ids = inputs.shared[inputs.digits[inputs.shared]]
    return np.stack([ids, ids], 1)


def _unsupervised(inputs: InitInputs) -> np.ndarray:
    n = inputs.init_vocab
    x_rows, z_rows = inputs.x_rows[:n], inputs.z_rows[:n]
    pairs = unsupervised_seed(
        inputs.x[torch.from_numpy(x_rows)],
        inputs.z[torch.from_numpy(z_rows)],
        csls_k=inputs.csls_k,
        block_size=inputs.block_size,
    ).numpy()
    return np.stack([x_rows[pairs[:, 0]], z_rows[pairs[:, 1]]], 1)


INITS: dict[str, Callable[[InitInputs], np.ndarray]] = {
    "identical": _identical,
    "numerals": _numerals,
    "unsupervised": _unsupervised,
}
"""Each initialisation's [n, 2] int64 (source id, pivot id) pairs, by name."""
