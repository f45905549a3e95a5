"""Random aligned substitution (RAS, mRASP's code-switching): dictionary words of a sentence
replaced by one of their translations, each with a fixed probability.

Where it runs: on token ids, on the fly, in the train unit, with the step's seeded generator.
A SentencePiece model trained here splits text at whitespace and marks the first piece of
every word with ``▁`` (U+2581), so the pieces of a batch fall into words without the text:
a word is a piece that starts with ``▁`` and the pieces up to the next one. A dictionary
word is looked up as the pieces SentencePiece gives it alone, which are the pieces it has in
a sentence. Substituting on ids keeps the shards as they are (one set of shards serves
every system, with and without RAS), costs no re-encoding, and is deterministic and
resumable for free: the loop seeds the generator from (seed, step, rank), so a resumed run
substitutes exactly what the killed one would have. Substituting words before encoding
would need the text at training time or shards built per rate and seed.

What counts as a word for the dictionary: its pieces, without trailing punctuation pieces
(``Delete.`` is ``▁Delete`` and ``.``: ``▁Delete`` is looked up, the ``.`` stays). Control
ids (pad, ``</s>``, language tags, the pair separator) are never part of a word, so a
substitution never reaches across them.

The dictionary file: one ``source<TAB>target`` pair a line, optionally with a third column
(a score, which is ignored here: the file holds what is to be used); the file name says the
languages, ``<src>-<tgt>.tsv`` (``en-de.tsv``, as the demo corpus' dictionary and the induced
one are named). A pair serves both directions. Each word is also looked up in its
lower-cased and capitalised forms, since dictionaries are mostly lower-case while sentences
start with a capital: a form with a capital initial gets its translation with one, the
others the translation as written. Entries with a space in either word are skipped: RAS
replaces words, not phrases.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megasemface.data.text.lines import TextFileError, read_lines
from megasemface.data.text.tokenizer import Tokenizer

__all__ = [
    "WORD_START",
    "RandomAlignedSubstitution",
    "RasDictionary",
    "RasDictionaryError",
    "RasResult",
    "dictionary_languages",
]

WORD_START = "\u2581"
"""SentencePiece's word-boundary marker, the first character of a word's first piece."""

_NAME = re.compile(r"^([a-z]{2,3}(?:_[A-Za-z]+)?)-([a-z]{2,3}(?:_[A-Za-z]+)?)(?:\..*)?$")


class RasDictionaryError(ValueError):
    """A dictionary file cannot be used; the message names the file and what to do."""


Pieces = tuple[int, ...]


def dictionary_languages(path: Path, known: Sequence[str]) -> tuple[str, str]:
    """The (source, target) languages of a dictionary file, from its name ``<src>-<tgt>.tsv``.

    Raises:
        RasDictionaryError: the name gives no pair of ``known`` languages.
    """
    match = _NAME.match(path.name.removesuffix(".tsv"))
    if match is None or match[1] not in known or match[2] not in known or match[1] == match[2]:
        raise RasDictionaryError(
            f"{path}: name the dictionary <src>-<tgt>.tsv with two of the tokenizer's "
            f"languages {list(known)} (its columns' languages), e.g. en-de.tsv"
        )
    return match[1], match[2]


def _forms(source: str, target: str) -> dict[str, str]:
    """The source word as written, lower-cased and with a capital initial, each with its
    translation: capitalised when the form is, else as written."""
    capital = target[:1].upper() + target[1:]
    forms = (source, source.lower(), source[:1].upper() + source[1:])
    return {form: capital if form[:1].isupper() else target for form in forms}


@dataclasses.dataclass(frozen=True)
class RasDictionary:
    """Word translations as piece ids: ``{language: {word pieces: candidate pieces}}``.

    The candidates of a word are the translations in every other language the dictionaries
    give, so drawing one uniformly picks the language at random too (mRASP's polysemy and
    language choice). Build it with :meth:`load`.
    """

    words: dict[str, dict[Pieces, tuple[Pieces, ...]]]
    files: dict[str, dict[str, int]]
    """Per file: ``entries`` (pairs read), ``skipped`` (phrases, words with no pieces)."""

    @classmethod
    def load(cls, paths: Iterable[Path], tokenizer: Tokenizer) -> RasDictionary:
        """Reads dictionary files (``<src>-<tgt>.tsv``) for ``tokenizer``.

        Raises:
            RasDictionaryError: a file is missing, badly named, malformed or has no pair.
        """
        found: dict[str, dict[Pieces, list[Pieces]]] = {}
        files: dict[str, dict[str, int]] = {}
        for path in map(Path, paths):
            src, tgt = dictionary_languages(path, tokenizer.languages)
            if not path.is_file():
                raise RasDictionaryError(f"RAS dictionary not found: {path}")
            entries = skipped = 0
            try:
                lines = read_lines(path)
            except TextFileError as exc:
                raise RasDictionaryError(str(exc)) from None
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                fields = line.split("\t")
                if len(fields) < 2 or not fields[0].strip() or not fields[1].strip():
                    raise RasDictionaryError(
                        f"{path}:{number}: expected 'source<TAB>target[<TAB>score]', got "
                        f"{line[:60]!r}"
                    )
                entries += 1
                source, target = fields[0].strip(), fields[1].strip()
                if any(c.isspace() for c in source + target):
                    skipped += 1
                    continue
                added = False
                for lang, word, translation in ((src, source, target), (tgt, target, source)):
                    for s, t in _forms(word, translation).items():
                        s_ids, t_ids = _word_pieces(tokenizer, s), _word_pieces(tokenizer, t)
                        if s_ids and t_ids and s_ids != t_ids:
                            found.setdefault(lang, {}).setdefault(s_ids, []).append(t_ids)
                            added = True
                skipped += not added
            if entries == 0:
                raise RasDictionaryError(
                    f"{path}: no 'source<TAB>target' word pairs; pass a bilingual word list"
                )
            files[str(path)] = {"entries": entries, "skipped": skipped}
        words = {
            lang: {key: tuple(dict.fromkeys(values)) for key, values in table.items()}
            for lang, table in found.items()
        }
        return cls(words, files)

    def size(self, lang: str) -> int:
        """Words (piece sequences, case forms counted apart) with a translation in ``lang``."""
        return len(self.words.get(lang, {}))


def _word_pieces(tokenizer: Tokenizer, word: str) -> Pieces:
    """The pieces of ``word`` alone: its pieces in a sentence; () when it has unknown pieces
    or does not start a word."""
    (ids,) = tokenizer.encode([word])
    if not ids or tokenizer.unk_id in ids:
        return ()
    if not tokenizer.processor.IdToPiece(ids[0]).startswith(WORD_START):
        return ()
    return tuple(ids)


@dataclasses.dataclass
class RasResult:
    """A substituted batch and its counts."""

    tokens_BT: torch.Tensor
    lengths_B: torch.Tensor
    words: int
    """Words in the batch."""
    candidates: int
    """Words the dictionary has a translation for."""
    replaced: int
    """Words replaced."""


class RandomAlignedSubstitution:
    """Replaces each dictionary word of a sentence, with probability ``prob``, by one of its
    translations drawn uniformly; everything else is kept, in place.

    Randomness: two draws per batch from the given generator, ``rand(n)`` for the choices
    and ``rand(n)`` for the candidates (n: dictionary words in the batch), whatever their
    outcome, so the generator's state after a call depends only on the batch.
    """

    def __init__(self, dictionary: RasDictionary, tokenizer: Tokenizer, prob: float) -> None:
        if not 0 <= prob <= 1:
            raise ValueError(f"the RAS probability must be in [0, 1], got {prob}")
        self.dictionary = dictionary
        self.prob = prob
        processor = tokenizer.processor
        pieces = [processor.IdToPiece(i) for i in range(tokenizer.vocab_size)]
        control = [
            processor.IsControl(i) or processor.IsUnknown(i) for i in range(tokenizer.vocab_size)
        ]
        self.starts_word = [
            p.startswith(WORD_START) and not c for p, c in zip(pieces, control, strict=True)
        ]
        """A piece that begins a word."""
        self.control = control
        """Pieces that are never part of a word (pad, </s>, language tags, the separator, unk)."""
        self.punctuation = [
            not s and not c and not any(ch.isalnum() for ch in p)
            for p, s, c in zip(pieces, self.starts_word, control, strict=True)
        ]
        """Pieces that continue a word without letters or digits: trailing punctuation."""
        self.pad_id = tokenizer.pad_id

    def words(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """The words of one sentence: (start, end of the part looked up, end), so that
        ``ids[start:core]`` is the word without trailing punctuation."""
        spans: list[tuple[int, int, int]] = []
        start: int | None = None
        for position, token in enumerate([*ids, None]):
            boundary = token is None or self.control[token] or self.starts_word[token]
            if boundary and start is not None:
                core = position
                while core - 1 > start and self.punctuation[ids[core - 1]]:
                    core -= 1
                spans.append((start, core, position))
                start = None
            if token is not None and not self.control[token] and (boundary or start is None):
                start = position
        return spans

    def __call__(
        self,
        tokens_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        lang: str,
        generator: torch.Generator,
        max_length: int | None = None,
    ) -> RasResult:
        """Substitutes the sentences of a batch in ``lang`` (padded ids, lengths).

        Rows that grow past ``max_length`` are cut to it. Returns the new batch, padded to
        its longest row, on the input's device and dtype.
        """
        table = self.dictionary.words.get(lang, {})
        rows = [row[:n] for row, n in zip(tokens_BT.tolist(), lengths_B.tolist(), strict=True)]
        found: list[tuple[int, int, int, tuple[Pieces, ...]]] = []  # row, start, core, options
        words = 0
        for index, ids in enumerate(rows):
            spans = self.words(ids)
            words += len(spans)
            for start, core, _ in spans:
                options = table.get(tuple(ids[start:core]))
                if options:
                    found.append((index, start, core, options))
        choose = torch.rand(len(found), generator=generator).tolist()
        pick = torch.rand(len(found), generator=generator).tolist()
        replaced = 0
        # From the back of each row, so the positions of earlier words stay valid.
        for (index, start, core, options), u, v in reversed(
            list(zip(found, choose, pick, strict=True))
        ):
            if u < self.prob:
                chosen = options[min(int(v * len(options)), len(options) - 1)]
                rows[index][start:core] = chosen
                replaced += 1
        if max_length is not None:
            rows = [ids[:max_length] for ids in rows]
        width = max((len(ids) for ids in rows), default=0)
        out = torch.full((len(rows), width), self.pad_id, dtype=tokens_BT.dtype)
        for index, ids in enumerate(rows):
            out[index, : len(ids)] = torch.tensor(ids, dtype=tokens_BT.dtype)
        lengths = torch.tensor([len(ids) for ids in rows], dtype=lengths_B.dtype)
        return RasResult(
            out.to(tokens_BT.device), lengths.to(lengths_B.device), words, len(found), replaced
        )
