"""Reading corpora, cleaning lines, and the de-duplication hash set."""

from __future__ import annotations

import bz2
import gzip
import lzma
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zstandard

from megasemface.data.text import hashset
from megasemface.data.text.cleaning import DropReason, clean_block, clean_line, clean_lines
from megasemface.data.text.hashset import HashSet
from megasemface.data.text.languages import lang_from_tag, lang_tag, temperature_probs
from megasemface.data.text.textio import (
    CorpusReadError,
    LineReader,
    count_lines,
    iter_lines,
    parse_lang_path,
    split_lines,
)

TEXT = b"first\r\nsecond\n\n  third  \nlast without newline"
EXPECTED = [b"first", b"second", b"", b"  third  ", b"last without newline"]


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".xz", ".zst"])
def test_every_codec_yields_the_same_lines(tmp_path: Path, suffix: str) -> None:
    compress = {
        "": lambda b: b,
        ".gz": gzip.compress,
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
        ".zst": zstandard.ZstdCompressor().compress,
    }[suffix]
    path = tmp_path / f"corpus.txt{suffix}"
    path.write_bytes(compress(TEXT))
    assert list(iter_lines(path)) == EXPECTED
    with LineReader(path) as reader:
        blocks = list(reader.iter_blocks(7))  # smaller than some lines
        assert reader.compressed_bytes_read == path.stat().st_size
    assert [line for b in blocks for line in split_lines(b)] == EXPECTED
    assert sum(count_lines(b) for b in blocks) == len(EXPECTED)
    assert b"".join(blocks) == TEXT


def test_missing_file_and_bad_specs_are_reported() -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        LineReader("nope.txt")
    with pytest.raises(ValueError, match="LANG:PATH"):
        parse_lang_path(["justapath.txt"])
    with pytest.raises(ValueError, match="invalid language code"):
        parse_lang_path(["e n:file.txt"])
    specs = parse_lang_path(["en:a.txt", "de:b.txt", "en:c.txt"])
    assert [(s.lang, [p.name for p in s.paths]) for s in specs] == [
        ("en", ["a.txt", "c.txt"]),
        ("de", ["b.txt"]),
    ]


def test_clean_line_reasons() -> None:
    assert clean_line(b"  a\t b  ", 10) == (DropReason.KEPT, "a b")
    assert clean_line(b"\xe2\x82", 10)[0] == DropReason.INVALID_UTF8
    assert clean_line(b"a\x1bb", 10)[0] == DropReason.CONTROL_CHARS
    assert clean_line("a\u2029b".encode(), 10)[0] == DropReason.CONTROL_CHARS
    assert clean_line(b" \t ", 10)[0] == DropReason.EMPTY
    assert clean_line(b"x" * 11, 10)[0] == DropReason.TOO_LONG_CHARS
    assert clean_line("\u00a0non\u00a0breaking\u3000".encode(), 40) == (
        DropReason.KEPT,
        "non breaking",
    )


def test_block_cleaning_equals_line_cleaning() -> None:
    """The whole-block fast path must agree with the line-by-line rules on any input."""
    rng = random.Random(0)
    pieces = [
        b"a",
        b"xyz",
        b" ",
        b"  ",
        b"\t",
        b"\n",
        b"\r",
        b"\xff",
        b"\xc3\xa9",
        "\u2028".encode(),
        b"\x07",
        "\u0085".encode(),
        "\u00a0".encode(),
        "\u3000".encode(),
        "\u2003".encode(),
        b"\x0c",
        b"\x1c",
    ]
    for _ in range(5000):
        block = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.5:
            block += b"\n"
        fast = clean_block(block, 10)
        slow = clean_lines(split_lines(block), 10)
        assert fast[0].tolist() == slow[0].tolist(), block
        assert fast[1].tolist() == slow[1].tolist(), block
        assert fast[2] == slow[2], block


def test_hash_set_matches_a_python_set() -> None:
    rng = np.random.default_rng(0)
    table, reference = HashSet(16), set()
    for _ in range(300):
        values = rng.integers(1, 5000, size=rng.integers(0, 200)).astype(np.uint64)
        expected = []
        for value in values.tolist():
            expected.append(value not in reference)
            reference.add(value)
        assert table.insert(values).tolist() == expected
    assert len(table) == len(reference)
    assert table.nbytes <= 32 * len(reference)  # the documented bound per element
    with pytest.raises(ValueError, match="reserved"):
        table.insert(np.array([0], dtype=np.uint64))


def test_a_doubling_hash_set_holds_little_beside_its_two_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Doubling re-inserts the old table a slice at a time: at 50M sentences, re-inserting
    all 33M values at once took 3x the new table on top of it (2.4 GB more)."""
    monkeypatch.setattr(hashset, "_GROW_SLOTS", 1 << 12)
    table = HashSet()
    values = np.random.default_rng(0).integers(1, 2**63, size=32_780, dtype=np.uint64)
    table.insert(values[:32_760])  # 2^16 slots, just under half full
    old = table.nbytes
    tracemalloc.start()
    try:
        assert table.insert(values[32_760:]).all()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert table.nbytes == 2 * old == HashSet.nbytes_for(len(values))
    # The new table, and the slice's probing temporaries (about 50 bytes a value).
    assert peak < table.nbytes + 64 * (1 << 12)
    assert not table.insert(values).any() and len(table) == len(values)


def test_a_damaged_file_is_reported_with_the_last_line_read_whole(tmp_path: Path) -> None:
    """A later gzip member cut short: the error names the line reading stopped after, so
    that damage 30M lines into a file can be found (``zcat | sed -n``)."""
    members = [
        gzip.compress(b"".join(b"line %d\n" % i for i in range(k, k + 3000))) for k in (0, 3000)
    ]
    path = tmp_path / "two-members.txt.gz"
    path.write_bytes(members[0] + members[1][: len(members[1]) // 2])
    read: list[bytes] = []
    with pytest.raises(CorpusReadError) as error, LineReader(path) as reader:
        read.extend(reader)
    assert len(read) >= 3000
    assert f"{path}: cannot read the file past line {len(read):,} " in str(error.value)
    counted: list[int] = []
    with pytest.raises(CorpusReadError) as error, LineReader(path) as reader:
        counted.extend(count_lines(block) for block in reader.iter_blocks(1000))
    assert f"past line {sum(counted):,} " in str(error.value)


def test_language_tags_and_temperature() -> None:
    assert lang_tag("de") == "__de__" and lang_from_tag("__de__") == "de"
    assert lang_from_tag("<mask>") is None and lang_from_tag("____") is None
    probs = temperature_probs({"en": 900, "kk": 100}, 1.0)
    assert probs == pytest.approx({"en": 0.9, "kk": 0.1})
    flat = temperature_probs({"en": 900, "kk": 100}, 1e9)
    assert flat == pytest.approx({"en": 0.5, "kk": 0.5})
    balanced = temperature_probs({"en": 900, "kk": 100}, 2.0)
    assert 0.1 < balanced["kk"] < 0.5
    assert temperature_probs({"en": 5, "xx": 0}, 2.0)["xx"] == 0.0
    with pytest.raises(ValueError):
        temperature_probs({"en": 1}, 0.0)
