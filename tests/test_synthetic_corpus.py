"""The synthetic corpus of news-length sentences that measures the data path at scale
(megasemface.data.demo.synthetic_corpus): seeded, made of the source's words in their
order, the lengths and repeats asked for, and written as the tools read it."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from megasemface.data.demo.synthetic_corpus import (
    SyntheticCorpusConfig,
    WordSource,
    generate_blocks,
    write_corpus,
)
from megasemface.data.text.textio import iter_lines

SOURCE = WordSource(" ".join(f"w{i}" for i in range(5000)).encode())


def _lines(config: SyntheticCorpusConfig, stream: str = "en") -> list[bytes]:
    return b"".join(generate_blocks(SOURCE, config, stream)).splitlines()


def test_the_same_seed_gives_the_same_corpus_and_streams_differ() -> None:
    config = SyntheticCorpusConfig(sentences=3000, batch=1000)
    assert _lines(config) == _lines(config)
    assert _lines(config) != _lines(config, "de")
    assert _lines(config) != _lines(SyntheticCorpusConfig(sentences=3000, batch=1000, seed=1))


def test_sentences_have_news_lengths_and_the_source_word_order() -> None:
    config = SyntheticCorpusConfig(sentences=20_000, duplicate_fraction=0.0)
    lines = _lines(config)
    assert len(lines) == 20_000
    lengths = np.array([len(line.split(b" ")) for line in lines])
    assert 25 <= lengths.mean() <= 29  # news text: 25-30 words on average
    assert np.percentile(lengths, 99) > 3 * np.median(lengths)  # a long tail
    indices = [[int(word[1:]) for word in line.split(b" ")] for line in lines[:2000]]
    assert all(0 <= i < SOURCE.num_words for line in indices for i in line)
    # Runs of 3-12 consecutive source words: most neighbours are neighbours in the source.
    pairs = [pair for line in indices for pair in itertools.pairwise(line)]
    assert sum(b == a + 1 for a, b in pairs) / len(pairs) > 0.8
    assert len(set(lines)) > 0.999 * len(lines)  # short sentences alone repeat by chance


def test_repeats_come_at_the_rate_asked() -> None:
    lines = _lines(SyntheticCorpusConfig(sentences=20_000, duplicate_fraction=0.1))
    assert 0.08 < 1 - len(set(lines)) / len(lines) < 0.12


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.txt.gz"])
def test_the_written_corpus_reads_back_with_its_figures(tmp_path: Path, name: str) -> None:
    config = SyntheticCorpusConfig(sentences=5000, batch=700)
    figures = write_corpus(SOURCE, tmp_path / name, config, stream="en")
    lines = list(iter_lines(tmp_path / name))
    assert lines == _lines(config)
    words = [len(line.split(b" ")) for line in lines]
    assert figures["lines"] == 5000 and figures["words"] == sum(words)
    assert figures["words_percentiles"]["max"] == max(words)
    assert figures["words_percentiles"]["p50"] == int(np.percentile(words, 50, method="lower"))
    assert figures["disk_bytes"] == (tmp_path / name).stat().st_size
    assert (figures["disk_bytes"] < figures["text_bytes"]) == name.endswith(".gz")


@pytest.mark.parametrize(
    "overrides",
    [{"sentences": -1}, {"mean_words": 0.5}, {"min_run": 0}, {"duplicate_fraction": 1.0}],
)
def test_bad_options_are_refused(overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SyntheticCorpusConfig(**{"sentences": 10, **overrides})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no words"):
        WordSource(b" \n ")
