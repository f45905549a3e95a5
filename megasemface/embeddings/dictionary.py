"""A word dictionary induced from the mapped cross-lingual spaces: mRASP's RAS dictionary.

mRASP substitutes words by their translations from MUSE's ground-truth dictionaries; this
induces one from the project's own cross-lingual embeddings instead, so that no
dictionary is needed (the demo corpus' dictionary is the evaluation's gold standard, kept
out of training). A word has a vector only when SentencePiece encodes it as one piece
(``▁word``), so the candidates of each language are its single-piece words: pieces that
start a word, have two characters or more, one a letter (single letters such as "I" or "C"
pair by chance), and occur at least ``dict_min_count`` times in that language as
a whole word, not followed by a piece that continues the word (``▁entfer`` of ``▁entfer
nen`` is a word's beginning, not a word; :func:`whole_word_counts`). Candidates are ranked
by those counts.

For each direction (source onto target and back), the ``dictionary_words`` most frequent
words of the source language (mRASP uses the 1,000 most frequent words of its dictionaries)
are translated by their CSLS nearest neighbour among the target language's words, the same
retrieval the build's dictionary induction and BLI use. A pair is kept when its CSLS score
reaches ``dictionary_min_score`` (the confidence threshold) and the two words differ beyond
case: a word the joint vocabulary shares with its translation ("Server") needs no
substitution. Both directions' pairs are written in one file, ``src<TAB>tgt<TAB>score``,
best first; a pair found both ways is written once, with its higher score.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.embeddings.gold import GoldEntry
from megasemface.embeddings.mapping import csls_topk, normalize
from megasemface.files import atomic_write_text

__all__ = [
    "gold_precision",
    "induce_dictionary_pairs",
    "whole_word_counts",
    "word_candidates",
    "write_dictionary",
]

WORD_START = "\u2581"


def whole_word_counts(tokens: np.ndarray, offsets: np.ndarray, pieces: Sequence[str]) -> np.ndarray:
    """Per id, its occurrences in ``tokens`` (flat ids, sentence ``offsets``) that the next
    piece of the sentence does not continue (a piece that continues a word: no ``▁``, and a
    letter or digit, so trailing punctuation does not count)."""
    continues = np.array(
        [not p.startswith(WORD_START) and any(c.isalnum() for c in p) for p in pieces],
        dtype=bool,
    )
    continued = np.zeros(len(tokens), dtype=bool)
    if len(tokens) > 1:
        continued[:-1] = continues[tokens[1:]]
    ends = offsets[1:] - 1  # the last piece of a sentence is followed by nothing
    continued[ends[ends >= 0]] = False
    return np.bincount(tokens[~continued], minlength=len(pieces)).astype(np.int64)


def word_candidates(pieces: Sequence[str], counts: np.ndarray, min_count: int) -> np.ndarray:
    """Ids of single-piece words (two characters or more, a letter among them) counted
    ``min_count`` times, most frequent first (ties by id)."""
    is_word = np.array(
        [p.startswith(WORD_START) and len(p) > 2 and any(c.isalpha() for c in p) for p in pieces],
        dtype=bool,
    )
    ids = np.flatnonzero(is_word & (counts >= min_count))
    return ids[np.argsort(-counts[ids], kind="stable")]


def _nearest(
    src: torch.Tensor,
    tgt: torch.Tensor,
    src_ids: np.ndarray,
    tgt_ids: np.ndarray,
    queries: int,
    csls_k: int,
    block_size: int,
) -> list[tuple[int, int, float]]:
    """(source id, its CSLS-nearest target id, score) for the first ``queries`` source ids."""
    if len(src_ids) == 0 or len(tgt_ids) == 0:
        return []
    src_rows = normalize(src[torch.from_numpy(src_ids)])
    tgt_rows = normalize(tgt[torch.from_numpy(tgt_ids)])
    found, scores = csls_topk(
        src_rows[:queries],
        tgt_rows,
        1,
        csls_k=csls_k,
        block_size=block_size,
        src_context=src_rows,
    )
    return [
        (int(src_ids[i]), int(tgt_ids[int(found[i, 0])]), float(scores[i, 0]))
        for i in range(found.shape[0])
    ]


def induce_dictionary_pairs(
    spaces: dict[str, torch.Tensor],
    counts: dict[str, np.ndarray],
    pieces: Sequence[str],
    langs: tuple[str, str],
    *,
    words: int,
    min_count: int,
    min_score: float,
    csls_k: int = 10,
    block_size: int = 2048,
) -> list[tuple[int, int, float]]:
    """(``langs[0]`` piece id, ``langs[1]`` piece id, CSLS score) pairs, best first.

    ``spaces`` are the languages' vectors in the shared (mapped) space, [V, d] over the joint
    vocabulary whose pieces are ``pieces``; ``counts`` their whole-word counts.
    """
    src, tgt = langs
    src_ids = word_candidates(pieces, counts[src], min_count)
    tgt_ids = word_candidates(pieces, counts[tgt], min_count)
    best: dict[tuple[int, int], float] = {}
    forward = _nearest(spaces[src], spaces[tgt], src_ids, tgt_ids, words, csls_k, block_size)
    backward = _nearest(spaces[tgt], spaces[src], tgt_ids, src_ids, words, csls_k, block_size)
    oriented = forward + [(s, t, score) for t, s, score in backward]
    for s, t, score in oriented:
        if score < min_score or pieces[s].lower() == pieces[t].lower():
            continue
        best[(s, t)] = max(score, best.get((s, t), -np.inf))
    ranked = sorted(best.items(), key=lambda item: (-item[1], item[0]))
    return [(s, t, score) for (s, t), score in ranked]


def gold_precision(
    pairs: Sequence[tuple[int, int, float]], entries: Sequence[GoldEntry]
) -> dict[str, Any]:
    """How many induced pairs have their source word in the gold dictionary, and the share
    of those whose target is one of its gold translations (in any case form)."""
    gold: dict[int, set[int]] = {}
    for entry in entries:
        for s in entry.source:
            gold.setdefault(s, set()).update(entry.target)
    checked = [(s, t) for s, t, _ in pairs if s in gold]
    hits = sum(t in gold[s] for s, t in checked)
    return {"checked": len(checked), "precision": hits / len(checked) if checked else None}


def write_dictionary(
    path: Path, pairs: Sequence[tuple[int, int, float]], pieces: Sequence[str]
) -> None:
    """``src<TAB>tgt<TAB>score`` lines: the words without SentencePiece's ``▁``."""
    lines = [
        f"{pieces[s].removeprefix(WORD_START)}\t{pieces[t].removeprefix(WORD_START)}\t{score:.4f}"
        for s, t, score in pairs
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
