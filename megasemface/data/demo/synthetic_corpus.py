"""A monolingual corpus of any size with news-like sentence lengths, from a real text's words.

The demo corpus (``demo_corpus``) holds tens of thousands of short UI messages per language;
measuring the data path at the scale it is built for (tens of millions of sentences of news
or web text, 25-30 words on average, a long tail) needs more and longer lines. This module
makes them from a seeded generator over the words of such a text, so that the machine
needs nothing it does not have:

- a sentence's length in words is drawn from a log-normal distribution (``mean_words``,
  ``spread``): mean about 27 words, a median a little lower, a tail of 100-word and longer
  sentences, as in news crawls;
- its words are runs of 3 to 12 consecutive words of the source text, taken at random
  places and joined by spaces, so word frequencies, scripts and local word order are those
  of the real text, and sentences are almost never repeated by chance;
- ``duplicate_fraction`` of the sentences repeat another sentence of the same batch exactly,
  as crawled corpora repeat boilerplate, so that de-duplication has work to do.

Sentences are made in batches with numpy (byte ranges of the source text gathered at once),
a few hundred thousand sentences a second, and written as plain text or ``.txt.gz``. The
same source, configuration and seed give the same bytes.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["SyntheticCorpusConfig", "WordSource", "generate_blocks", "write_corpus"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticCorpusConfig:
    """How many sentences, how long, how often repeated. Invalid values raise ValueError."""

    sentences: int
    mean_words: float = 27.0
    """Mean sentence length in words (news: 25-30)."""
    spread: float = 0.6
    """Standard deviation of the log of the length: 0.6 puts 1% of sentences above 3.4x the
    median (about 80 words) and a few in 100,000 above 250."""
    max_words: int = 1000
    min_run: int = 3
    max_run: int = 12
    """Runs of consecutive source words a sentence is made of: from ``min_run`` to
    ``max_run`` words, the last run of a sentence cut to fit."""
    duplicate_fraction: float = 0.02
    seed: int = 0
    batch: int = 20_000
    """Sentences made at a time (about 4 MB of text and 40 MB of index arrays)."""

    def __post_init__(self) -> None:
        if self.sentences < 0 or self.batch < 1 or self.max_words < 1:
            raise ValueError("sentences must be >= 0, batch and max_words >= 1")
        if not (self.mean_words >= 1 and self.spread >= 0):
            raise ValueError("mean_words must be >= 1 and spread >= 0")
        if not 1 <= self.min_run <= self.max_run:
            raise ValueError("need 1 <= min_run <= max_run")
        if not 0 <= self.duplicate_fraction < 1:
            raise ValueError("duplicate_fraction must be in [0, 1)")


class WordSource:
    """The words of a text, joined by single spaces, and where each word starts."""

    def __init__(self, text: bytes) -> None:
        words = text.split()
        if not words:
            raise ValueError("the source text has no words")
        joined = b" ".join(words)
        self.data = np.frombuffer(joined, dtype=np.uint8)
        lengths = np.fromiter(map(len, words), np.int64, len(words))
        # starts[i] is where word i begins; starts[-1] is one past the text's last space,
        # so that the bytes of words i..j-1 are data[starts[i] : starts[j] - 1].
        self.starts = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=self.starts[1:])

    @classmethod
    def from_file(cls, path: Path) -> WordSource:
        return cls(Path(path).read_bytes())

    @property
    def num_words(self) -> int:
        return len(self.starts) - 1


def _runs_to_ranges(
    word_starts: np.ndarray, run_words: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts runs (first word, word count) into pieces that each lie in one sentence.

    The runs, one after another, make a sequence of words that the sentence ``lengths``
    split; returns each piece's first word and word count and the sentence it belongs to.
    """
    run_ends = np.cumsum(run_words)
    sentence_ends = np.cumsum(lengths)
    total = int(sentence_ends[-1])
    cuts = np.union1d(run_ends[run_ends < total], sentence_ends)
    piece_starts = np.concatenate(([0], cuts[:-1]))
    run = np.searchsorted(run_ends, piece_starts, side="right")
    offset = piece_starts - (run_ends[run] - run_words[run])
    sentence = np.searchsorted(sentence_ends, piece_starts, side="right")
    return word_starts[run] + offset, np.diff(np.concatenate(([0], cuts))), sentence


def _gather(data: np.ndarray, begin: np.ndarray, end: np.ndarray, last: np.ndarray) -> bytes:
    """The byte ranges ``data[begin:end]`` one after another, each followed by a space, or
    by a line end where ``last`` (the last piece of a sentence)."""
    sizes = end - begin
    out_starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1] + 1, out=out_starts[1:])
    total = int(out_starts[-1] + sizes[-1] + 1)
    out = np.empty(total, dtype=np.uint8)
    separators = out_starts + sizes
    out[separators] = np.where(last, ord("\n"), ord(" "))
    filled = np.ones(total, dtype=bool)
    filled[separators] = False
    # Source index of every output byte: each range's start, then consecutive bytes.
    shift = np.repeat(begin - (out_starts - np.arange(len(sizes))), sizes)
    out[filled] = data[shift + np.arange(int(sizes.sum()))]
    return out.tobytes()


def _batch(source: WordSource, config: SyntheticCorpusConfig, count: int, rng: Any) -> bytes:
    # A log-normal's mean is exp(mu + spread² / 2).
    mu = math.log(config.mean_words) - config.spread**2 / 2
    lengths = np.rint(rng.lognormal(mu, config.spread, count)).astype(np.int64)
    np.clip(lengths, 1, config.max_words, out=lengths)
    total = int(lengths.sum())
    # Enough runs to cover every word even if all were of the shortest length.
    runs = total // config.min_run + 1
    run_words = rng.integers(config.min_run, config.max_run + 1, runs)
    longest = min(config.max_run, source.num_words)
    run_words = np.minimum(run_words, longest)
    run_first = rng.integers(0, source.num_words - run_words + 1)
    first, words, sentence = _runs_to_ranges(run_first, run_words, lengths)
    # Repeats: a sentence takes the pieces of another one of the batch.
    order = np.arange(count)
    repeats = rng.random(count) < config.duplicate_fraction
    order[repeats] = rng.integers(0, count, int(repeats.sum()))
    piece_first = np.searchsorted(sentence, np.arange(count))
    piece_count = np.bincount(sentence, minlength=count)
    chosen_count = piece_count[order]
    pieces = np.repeat(piece_first[order] - np.cumsum(chosen_count) + chosen_count, chosen_count)
    pieces += np.arange(int(chosen_count.sum()))
    last = np.zeros(len(pieces), dtype=bool)
    last[np.cumsum(chosen_count) - 1] = True
    begin = source.starts[first[pieces]]
    end = source.starts[first[pieces] + words[pieces]] - 1
    return _gather(source.data, begin, end, last)


def generate_blocks(
    source: WordSource, config: SyntheticCorpusConfig, stream: str = ""
) -> Iterator[bytes]:
    """The corpus as blocks of whole lines (``config.batch`` sentences each, the last fewer).

    ``stream`` names the corpus among others of the same seed (a language code): each
    block's generator is seeded by the seed, the name and the block's number.
    """
    key = zlib.crc32(stream.encode("utf-8"))
    for number, begin in enumerate(range(0, config.sentences, config.batch)):
        count = min(config.batch, config.sentences - begin)
        rng = np.random.default_rng([config.seed, key, number])
        yield _batch(source, config, count, rng)


def write_corpus(
    source: WordSource,
    path: Path,
    config: SyntheticCorpusConfig,
    *,
    stream: str = "",
    compresslevel: int = 6,
) -> dict[str, Any]:
    """Writes the corpus to ``path`` (gzip-compressed when it ends in ``.gz``; the header
    carries no time, so the same corpus gives the same bytes); returns its figures: lines,
    words and bytes of text, bytes on disk, and the length distribution in words."""
    path = Path(path)
    # A histogram of lengths, not a list of them: memory stays flat at any corpus size.
    histogram = np.zeros(config.max_words + 1, dtype=np.int64)
    text_bytes = 0
    handle: IO[bytes]
    if path.suffix == ".gz":
        handle = gzip.GzipFile(path, "wb", compresslevel=compresslevel, mtime=0)
    else:
        handle = open(path, "wb")  # noqa: SIM115 - closed below, like the gzip file
    try:
        for block in generate_blocks(source, config, stream):
            handle.write(block)
            text_bytes += len(block)
            # Words per line from the block's spaces and line ends, without splitting it.
            raw = np.frombuffer(block, dtype=np.uint8)
            spaces = np.cumsum(raw == ord(" "))[raw == ord("\n")]
            words = np.diff(spaces, prepend=0) + 1
            histogram += np.bincount(words, minlength=len(histogram))
    finally:
        handle.close()
    lines = int(histogram.sum())
    cumulative = np.cumsum(histogram)

    def percentile(q: float) -> int:
        return int(np.searchsorted(cumulative, q / 100 * lines)) if lines else 0

    total_words = int(histogram @ np.arange(len(histogram)))
    return {
        "path": str(path),
        "lines": lines,
        "words": total_words,
        "text_bytes": text_bytes,
        "disk_bytes": path.stat().st_size,
        "mean_words": total_words / lines if lines else 0.0,
        "words_percentiles": {f"p{q}": percentile(q) for q in (50, 90, 99)}
        | {"max": int(np.flatnonzero(histogram).max(initial=0))},
    }
