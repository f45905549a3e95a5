"""Gold-dictionary words in text, and their codes: the inputs of the paper's Fig. 5.

The dictionary is read as the BLI evaluation reads it (:mod:`megasemface.embeddings.gold`):
a word is measurable when SentencePiece writes one of its case forms as a single piece, so
a word *is* one subword here, and longer words are left out rather than stood in for by
their first piece or a mean over pieces. A word occurs where one of its pieces stands as a
whole word in the text: the next piece does not continue it (``▁Delete`` followed by ``d``
is "Deleted", not "Delete"). Its code distribution is the mean over its first occurrences
of the VQ layer's noise-free p(code | h), h the encoder output there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings.gold import gold_languages, load_gold_dictionary
from megasemface.evaluation.diagnostics.figures import WordCodes, word_codes
from megasemface.evaluation.diagnostics.sources import DiagnosticsError

__all__ = [
    "GoldPairs",
    "Position",
    "Word",
    "continues_word",
    "load_gold_pairs",
    "whole_word_occurrences",
    "words_codes",
]

Word = tuple[int, ...]
"""A dictionary word: the ids of its single-piece case forms (``GoldEntry``), sorted."""

Position = tuple[int, int]
"""(sentence index, token index) in a language's text."""

_CODE_CHUNK = 512
"""Occurrences scored at a time: bounds the [n, K] log-probabilities (200 MiB at the paper's
102,400 codes)."""


@dataclasses.dataclass
class GoldPairs:
    """A gold dictionary's measurable pairs, and its words by piece id per language."""

    source_lang: str
    target_lang: str
    entries: int
    """Word pairs in the file."""
    single_piece: int
    """Pairs whose two words both have a single-piece case form."""
    pairs: list[tuple[Word, Word]]
    """The distinct measurable pairs, in file order."""
    forms: dict[str, dict[int, list[Word]]]
    """Per language: piece id -> the words that have it as a case form."""


def load_gold_pairs(
    path: Path, tokenizer: Tokenizer, langs: Sequence[str], pair: tuple[str, str] | None
) -> GoldPairs:
    """The dictionary at ``path`` for texts of ``langs``; ``pair`` is its (source, target),
    by default read from a name like ``en-de.tsv``, else the first two of ``langs``."""
    entries, counts = load_gold_dictionary(path, tokenizer)
    source_lang, target_lang = pair or gold_languages(
        path, list(langs), langs[0], langs[1:] or langs
    )
    if source_lang not in langs or target_lang not in langs or source_lang == target_lang:
        raise DiagnosticsError(
            f"the dictionary {path} pairs {source_lang}-{target_lang}: give a text of each "
            f"language (--text {source_lang}:FILE --text {target_lang}:FILE)"
        )
    pairs = [(tuple(sorted(e.source)), tuple(sorted(e.target))) for e in entries]
    forms: dict[str, dict[int, list[Word]]] = {source_lang: {}, target_lang: {}}
    for source, target in pairs:
        for lang, word in ((source_lang, source), (target_lang, target)):
            for piece in word:
                known = forms[lang].setdefault(piece, [])
                if word not in known:
                    known.append(word)
    return GoldPairs(
        source_lang,
        target_lang,
        counts["entries"],
        counts["single_piece"],
        list(dict.fromkeys(pairs)),
        forms,
    )


def continues_word(tokenizer: Tokenizer) -> list[bool]:
    """Per piece id: whether the piece continues the word before it (no ``▁`` and a letter
    or digit first)."""
    processor = tokenizer.processor
    pieces = [processor.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    return [not p.startswith("\u2581") and p[:1].isalnum() for p in pieces]


def whole_word_occurrences(
    ids: Sequence[Sequence[int]], forms: dict[int, list[Word]], continues: list[bool], cap: int
) -> dict[Word, list[Position]]:
    """The first ``cap`` positions, in text order, where each word stands as a whole word."""
    found: dict[Word, list[Position]] = {}
    for i, sentence in enumerate(ids):
        for t, piece in enumerate(sentence):
            words = forms.get(piece)
            if not words or (t + 1 < len(sentence) and continues[sentence[t + 1]]):
                continue
            for word in words:
                positions = found.setdefault(word, [])
                if len(positions) < cap:
                    positions.append((i, t))
    return found


def words_codes(
    code_log_probs: Callable[[torch.Tensor], torch.Tensor],
    occurrences: dict[Word, list[Position]],
    features: dict[Position, torch.Tensor],
    k: int,
) -> dict[Hashable, WordCodes]:
    """Each word's codes from the encoder outputs ``features`` at its occurrences, by
    ``code_log_probs`` (the interface's distribution over its codes, [N, K])."""
    out: dict[Hashable, WordCodes] = {}
    words = sorted(occurrences)
    start = 0
    while start < len(words):
        chunk, size = [], 0
        while start < len(words) and (
            not chunk or size + len(occurrences[words[start]]) <= _CODE_CHUNK
        ):
            chunk.append(words[start])
            size += len(occurrences[words[start]])
            start += 1
        h_ND = torch.stack([features[p] for word in chunk for p in occurrences[word]])
        log_probs = code_log_probs(h_ND)
        offset = 0
        for word in chunk:
            count = len(occurrences[word])
            out[word] = word_codes(log_probs[offset : offset + count], k)
            offset += count
    return out
