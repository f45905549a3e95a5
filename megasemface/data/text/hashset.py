"""A compact set of 64-bit hashes for exact de-duplication of large corpora.

A Python ``set`` of ints costs about 70 bytes per element (50M sentences: 3.5 GB). This
open-addressing table stores raw uint64 values at a load factor between 1/4 and 1/2, so it
costs 16 to 32 bytes per distinct sentence (50M: 0.8 to 1.6 GB; while it doubles, the old
table and the new one, 1.5x the new size, for a moment). Insertion is vectorised over a
batch of hashes with numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HashSet"]

_EMPTY = np.uint64(0)
_GROW_SLOTS = 1 << 20
"""Slots of the old table re-inserted at a time while the table doubles: probing takes about
50 bytes of temporaries per value, which over a whole 33M-value table came to 3x the new
table's size on top of it (3.4 GB at 50M sentences); a slice at a time, about 25 MB."""


class HashSet:
    """A set of non-zero uint64 values with batched, order-preserving insertion."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        size = 1 << max(4, int(capacity - 1).bit_length())
        self._table = np.zeros(size, dtype=np.uint64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    @staticmethod
    def nbytes_for(distinct: int) -> int:
        """The table's size in bytes once ``distinct`` values are in, from the default
        capacity: the smallest power of two of slots from 2^16 that keeps it at most half
        full (a batch that crosses the limit doubles it first, so near a power of two the
        table may be twice this)."""
        slots = 1 << 16
        while 2 * distinct > slots:
            slots *= 2
        return slots * np.dtype(np.uint64).itemsize

    def insert(self, values: np.ndarray) -> np.ndarray:
        """Inserts values in order; returns a mask that is True where a value was new.

        A value repeated inside the batch is new only at its first position, exactly as if
        the values had been inserted one at a time.
        """
        values = np.asarray(values, dtype=np.uint64)
        if (values == _EMPTY).any():
            raise ValueError("0 is reserved for empty slots; map hash 0 to another value")
        is_new = np.zeros(len(values), dtype=bool)
        if len(values) == 0:
            return is_new
        _, first = np.unique(values, return_index=True)
        candidates = np.sort(first)
        while 2 * (self._count + len(candidates)) > len(self._table):
            self._grow()
        inserted = self._insert_unique(values[candidates])
        is_new[candidates[inserted]] = True
        return is_new

    def _insert_unique(self, values: np.ndarray) -> np.ndarray:
        """Inserts distinct values; returns a mask of those that were not present."""
        mask = np.uint64(len(self._table) - 1)
        slots = values & mask
        inserted = np.zeros(len(values), dtype=bool)
        pending = np.arange(len(values))
        while len(pending):
            current = self._table[slots[pending]]
            found = current == values[pending]
            empty = current == _EMPTY
            # Several pending values may race for one empty slot: write them all, read back,
            # and the value that landed wins; the others probe on.
            claim = pending[empty]
            self._table[slots[claim]] = values[claim]
            won = self._table[slots[claim]] == values[claim]
            inserted[claim[won]] = True
            self._count += int(won.sum())
            done = found.copy()
            done[np.flatnonzero(empty)[won]] = True
            pending = pending[~done]
            slots[pending] = (slots[pending] + np.uint64(1)) & mask
        return inserted

    def _grow(self) -> None:
        old = self._table
        self._table = np.zeros(2 * len(old), dtype=np.uint64)
        self._count = 0
        for begin in range(0, len(old), _GROW_SLOTS):
            part = old[begin : begin + _GROW_SLOTS]
            self._insert_unique(part[part != _EMPTY])
