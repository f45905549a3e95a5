"""Seed dictionaries of the mapping that come from outside the monolingual spaces.

The paper's mapping (VecMap) is unsupervised: its initial dictionary is the pieces both
languages share (``init="identical"``), their numerals, or VecMap's similarity-distribution
initialisation (:mod:`megasemface.embeddings.table`). In the low-resource supervised setting
a few thousand translated sentences are at hand as well; this module turns them into a seed
dictionary of piece-id pairs, a departure from the paper (docs/model.md):

- :func:`parallel_seed`: pieces that co-occur in aligned sentence pairs, scored by the Dice
  coefficient ``2 c(s, t) / (c(s) + c(t))`` over sentence counts, kept when each is the
  other's best partner (mutual best) and they co-occur ``min_count`` times or more;
- :func:`word_list_seed`: a given ``source<TAB>target`` word list (each side's single-piece
  case forms, as the gold dictionary reads them).

Either gives a :class:`SeedDictionary`; BLI then leaves out the gold queries it covers
(:func:`disjoint_gold`), so that the evaluation dictionary is disjoint from the seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from megasemface.data.text.lines import read_lines
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings.gold import GoldDictionaryError, load_gold_dictionary

__all__ = [
    "SeedDictionary",
    "SeedDictionaryError",
    "SeedParallel",
    "cooccurrence_counts",
    "dice_pairs",
    "disjoint_gold",
    "parallel_seed",
    "word_list_seed",
]

# Keys of (source id, target id) pairs counted at once before merging into the totals: a
# bound on the memory of a chunk (8 bytes a key), whatever the size of the parallel data.
_CHUNK_KEYS = 1 << 22


class SeedDictionaryError(ValueError):
    """The seed dictionary cannot be read; the message names the file (and line)."""


@dataclasses.dataclass(frozen=True)
class SeedDictionary:
    """Piece-id pairs of two languages that seed the mapping of one onto the other."""

    langs: tuple[str, str]
    pairs: np.ndarray
    """[n, 2] int64 (``langs[0]`` id, ``langs[1]`` id) pairs, sorted, without repeats."""
    origin: str
    """Where the pairs come from, for the report (files and method)."""
    files: tuple[tuple[Path, Path], ...] = ()
    """The parallel files read, for the report (none: a word list)."""

    def oriented(self, src: str, tgt: str) -> np.ndarray:
        """The pairs as (``src`` id, ``tgt`` id): swapped when the languages are reversed."""
        if (src, tgt) == self.langs:
            return self.pairs
        if (tgt, src) == self.langs:
            return self.pairs[:, ::-1].copy()
        raise ValueError(f"the seed dictionary is {'-'.join(self.langs)}, not {src}-{tgt}")


def cooccurrence_counts(
    src: Sequence[np.ndarray], tgt: Sequence[np.ndarray], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sentence counts of aligned id sequences: (pair keys ``s * V + t``, their counts,
    per-id counts of the source side, per-id counts of the target side).

    An id counts once per sentence, so a piece repeated in a sentence weighs no more.
    """
    src_counts = np.zeros(vocab_size, dtype=np.int64)
    tgt_counts = np.zeros(vocab_size, dtype=np.int64)
    keys = np.zeros(0, dtype=np.int64)
    counts = np.zeros(0, dtype=np.int64)
    chunk: list[np.ndarray] = []
    pending = 0

    def merge() -> None:
        nonlocal keys, counts, chunk, pending
        chunk_keys, chunk_counts = np.unique(np.concatenate(chunk), return_counts=True)
        keys, inverse = np.unique(np.concatenate([keys, chunk_keys]), return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([counts, chunk_counts]))
        counts = counts.astype(np.int64)
        chunk, pending = [], 0

    for a, b in zip(src, tgt, strict=True):
        a, b = np.unique(a).astype(np.int64), np.unique(b).astype(np.int64)
        src_counts[a] += 1
        tgt_counts[b] += 1
        chunk.append((a[:, None] * vocab_size + b[None, :]).ravel())
        pending += len(a) * len(b)
        if pending >= _CHUNK_KEYS:
            merge()
    if chunk:
        merge()
    return keys, counts, src_counts, tgt_counts


def dice_pairs(
    keys: np.ndarray,
    counts: np.ndarray,
    src_counts: np.ndarray,
    tgt_counts: np.ndarray,
    vocab_size: int,
    min_count: int,
) -> np.ndarray:
    """[n, 2] (source id, target id) pairs that are each other's best by Dice coefficient
    among the pairs co-occurring ``min_count`` times or more; ties go to the lower id."""
    keep = counts >= min_count
    keys, counts = keys[keep], counts[keep]
    s, t = keys // vocab_size, keys % vocab_size
    dice = 2.0 * counts / (src_counts[s] + tgt_counts[t])
    # The best partner of each id: sort by (id, -dice, partner), take each id's first row.
    by_s = np.lexsort((t, -dice, s))
    first_s = by_s[np.r_[True, s[by_s][1:] != s[by_s][:-1]]] if len(s) else by_s
    by_t = np.lexsort((s, -dice, t))
    first_t = by_t[np.r_[True, t[by_t][1:] != t[by_t][:-1]]] if len(t) else by_t
    mutual = np.intersect1d(first_s, first_t)
    return np.stack([s[mutual], t[mutual]], 1).astype(np.int64).reshape(-1, 2)


def _encode_file(path: Path, tokenizer: Tokenizer) -> list[np.ndarray]:
    try:
        lines = read_lines(path)
    except FileNotFoundError:
        raise SeedDictionaryError(f"seed parallel file not found: {path}") from None
    except ValueError as exc:  # TextFileError: names the file and the line
        raise SeedDictionaryError(str(exc)) from None
    return [np.asarray(tokenizer.processor.encode(line), dtype=np.int64) for line in lines]


@dataclasses.dataclass(frozen=True)
class SeedParallel:
    """Line-aligned files of translated sentences that seed the mapping of two languages."""

    langs: tuple[str, str]
    files: tuple[tuple[Path, Path], ...]
    """(``langs[0]`` file, ``langs[1]`` file) pairs, read in order."""


def parallel_seed(source: SeedParallel, tokenizer: Tokenizer, min_count: int) -> SeedDictionary:
    """The mutual-best Dice pairs of ``source``'s sentence pairs."""
    src: list[np.ndarray] = []
    tgt: list[np.ndarray] = []
    for src_path, tgt_path in source.files:
        src_lines = _encode_file(Path(src_path), tokenizer)
        tgt_lines = _encode_file(Path(tgt_path), tokenizer)
        if len(src_lines) != len(tgt_lines):
            raise SeedDictionaryError(
                f"seed parallel files are not line-aligned: {src_path} has {len(src_lines)} "
                f"lines, {tgt_path} has {len(tgt_lines)}"
            )
        src += src_lines
        tgt += tgt_lines
    names = ", ".join(f"{a},{b}" for a, b in source.files)
    if not src:
        raise SeedDictionaryError(f"seed parallel files {names} are empty")
    vocab = tokenizer.vocab_size
    pairs = dice_pairs(*cooccurrence_counts(src, tgt, vocab), vocab, min_count)
    origin = f"dice over {len(src)} sentence pairs of {names}"
    return SeedDictionary(source.langs, pairs, origin, source.files)


def word_list_seed(langs: tuple[str, str], path: Path, tokenizer: Tokenizer) -> SeedDictionary:
    """Every (source form, target form) pair of the single-piece words of ``path``."""
    try:
        entries, _ = load_gold_dictionary(path, tokenizer)
    except GoldDictionaryError as exc:
        raise SeedDictionaryError(str(exc).replace("gold dictionary", "seed dictionary")) from None
    pairs = {(s, t) for entry in entries for s in entry.source for t in entry.target}
    array = np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)
    return SeedDictionary(langs, array, f"word list {path}")


def disjoint_gold(
    gold: Iterable[tuple[int, int]], seed: np.ndarray
) -> tuple[list[tuple[int, int]], int]:
    """The gold (query, target) pairs of the queries the seed does not cover, and how many
    queries were left out: a query goes when its id is a seed source or one of its gold
    targets is a seed target, so that no evaluated word was given to the mapping."""
    gold = list(gold)
    sources, targets = set(seed[:, 0].tolist()), set(seed[:, 1].tolist())
    covered = {q for q, t in gold if q in sources or t in targets}
    kept = [(q, t) for q, t in gold if q not in covered]
    return kept, len(covered)
