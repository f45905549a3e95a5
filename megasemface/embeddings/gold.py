"""Gold bilingual dictionaries for lexicon induction (BLI) on a subword vocabulary.

A dictionary line is ``source word<TAB>target word`` (or two space-separated words). A word
has a row in the table only when SentencePiece encodes it as one piece (``▁word``), so each
side is looked up as a single piece, in each of its case forms: the demo corpus' dictionary
(``megasemface.data.demo.demo_corpus``) is lower-cased, while its German nouns and the UI words
of both languages are mostly written capitalised ("Benutzer", "Delete"), and the lower-cased
piece is then rare or absent. Case forms are the same dictionary entry, so a retrieved
target counts as a hit in any of its forms; the query is the source form most frequent in
the source corpus, one query per source word.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megasemface.data.text.tokenizer import Tokenizer

__all__ = [
    "GoldDictionaryError",
    "GoldEntry",
    "gold_languages",
    "gold_queries",
    "load_gold_dictionary",
]


class GoldDictionaryError(ValueError):
    """The gold dictionary cannot be used; the message names the file and what to do."""


@dataclasses.dataclass(frozen=True)
class GoldEntry:
    """One dictionary word pair as the single-piece ids of each side's case forms."""

    source: tuple[int, ...]
    target: tuple[int, ...]


def _case_forms(word: str) -> list[str]:
    """The word as written, lower-cased and with a capital initial, without repeats."""
    return list(dict.fromkeys([word, word.lower(), word[:1].upper() + word[1:]]))


def _single_pieces(tokenizer: Tokenizer, word: str) -> tuple[int, ...]:
    ids = []
    for form in _case_forms(word):
        pieces = tokenizer.processor.encode(form)
        if len(pieces) == 1:
            ids.append(int(pieces[0]))
    return tuple(dict.fromkeys(ids))


def load_gold_dictionary(
    path: str | Path, tokenizer: Tokenizer
) -> tuple[list[GoldEntry], dict[str, int]]:
    """The entries of ``path`` whose two sides each have a single-piece case form.

    Returns the entries and counts: ``entries`` (lines read) and ``single_piece`` (kept).
    """
    path = Path(path)
    if not path.is_file():
        raise GoldDictionaryError(f"gold dictionary not found: {path}")
    entries: list[GoldEntry] = []
    lines = 0
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        number = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise GoldDictionaryError(
            f"{path}:{number}: not valid UTF-8 ({exc.reason}); convert the dictionary to UTF-8"
        ) from None
    for line in text.splitlines():
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 2 or not fields[0].strip() or not fields[1].strip():
            continue
        lines += 1
        source = _single_pieces(tokenizer, fields[0].strip())
        target = _single_pieces(tokenizer, fields[1].strip())
        if source and target:
            entries.append(GoldEntry(source, target))
    if lines == 0:
        raise GoldDictionaryError(
            f"{path}: no 'source<TAB>target' word pairs; pass a bilingual word list"
        )
    return entries, {"entries": lines, "single_piece": len(entries)}


def gold_queries(
    entries: Sequence[GoldEntry],
    source_counts: np.ndarray,
    target_counts: np.ndarray,
    min_count: int,
) -> list[tuple[int, int]]:
    """(query id, gold target id) pairs over forms seen ``min_count`` times in their corpus.

    Each source word gives one query, its most frequent form; all its target forms that are
    frequent enough are gold. Entries sharing a query pool their targets.
    """
    pairs: dict[int, set[int]] = {}
    for entry in entries:
        forms = [s for s in entry.source if source_counts[s] >= min_count]
        targets = {t for t in entry.target if target_counts[t] >= min_count}
        if forms and targets:
            query = max(forms, key=lambda s: (int(source_counts[s]), -s))
            pairs.setdefault(query, set()).update(targets)
    return [(q, t) for q in sorted(pairs) for t in sorted(pairs[q])]


def gold_languages(
    path: Path, languages: Sequence[str], pivot: str, others: Sequence[str]
) -> tuple[str, str]:
    """The dictionary's (source, target) languages from a name like ``en-de.tsv``."""
    parts = path.stem.split("-")
    if len(parts) == 2 and all(part in languages for part in parts):
        return parts[0], parts[1]
    return pivot, others[0]
