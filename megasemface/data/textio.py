"""Streaming access to plain or compressed text corpora.

Corpora are read as bytes, one line at a time, so that an invalid UTF-8 line can be
counted and dropped instead of failing the whole file, and so that memory stays flat
whatever the corpus size.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "CorpusSpec",
    "LineReader",
    "count_lines",
    "iter_lines",
    "parse_lang_path",
    "split_lines",
]

_BUFFER = 1 << 20


class LineReader:
    """Reads a plain or compressed corpus file line by line, as bytes.

    Supported: plain text, ``.gz``, ``.bz2``, ``.xz`` and ``.zst``. ``compressed_bytes_read``
    reports the position in the file on disk, which gives a progress bar and an ETA for
    compressed input whose line count is unknown in advance.

    Only ``\\n`` ends a line (a trailing ``\\r`` is removed too); other Unicode line separators
    stay inside the line, where the cleaning filters see them.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus file not found: {self.path}")
        self.size_on_disk = self.path.stat().st_size
        self._raw = open(self.path, "rb", buffering=_BUFFER)  # noqa: SIM115 - closed in close()
        suffix = self.path.suffix.lower()
        stream: BinaryIO
        if suffix == ".gz":
            stream = gzip.GzipFile(fileobj=self._raw, mode="rb")  # type: ignore[assignment]
        elif suffix == ".bz2":
            stream = bz2.BZ2File(self._raw, mode="rb")  # type: ignore[assignment]
        elif suffix == ".xz":
            stream = lzma.LZMAFile(self._raw, mode="rb")  # type: ignore[assignment]  # noqa: SIM115
        elif suffix == ".zst":
            import zstandard  # imported only when a .zst corpus is read

            reader = zstandard.ZstdDecompressor().stream_reader(self._raw, closefd=False)
            stream = io.BufferedReader(reader, buffer_size=_BUFFER)  # type: ignore[arg-type]
        else:
            stream = self._raw
        self._stream = stream

    @property
    def compressed_bytes_read(self) -> int:
        return self._raw.tell()

    def __iter__(self) -> Iterator[bytes]:
        for line in self._stream:
            if line.endswith(b"\n"):
                line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
            yield line

    def iter_blocks(self, size: int) -> Iterator[bytes]:
        """Yields runs of about ``size`` bytes that end at a line end (but maybe the last).

        Cutting text into whole lines without looking at each line keeps the reading
        process cheap when worker processes do the per-line work (see ``split_lines``).
        """
        carry = b""
        while data := self._stream.read(size):
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line end in this read: a line longer than size
                carry += data
                continue
            yield carry + data[:cut]
            carry = data[cut:]
        if carry:
            yield carry

    def close(self) -> None:
        if self._stream is not self._raw:
            self._stream.close()
        self._raw.close()

    def __enter__(self) -> LineReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_lines(block: bytes) -> list[bytes]:
    """The lines of a block from ``LineReader.iter_blocks``, exactly as iteration yields them."""
    lines = block.split(b"\n")
    if lines[-1] == b"":  # the block's final line end closes its last line
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def count_lines(block: bytes) -> int:
    """The number of lines ``split_lines(block)`` returns, without splitting."""
    return block.count(b"\n") + (0 if block.endswith(b"\n") or not block else 1)


def iter_lines(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Yields the lines of a plain or compressed corpus file as bytes (see LineReader)."""
    with LineReader(path) as reader:
        yield from reader


class CorpusSpec:
    """One language's corpus: a language code and one or more files read in order."""

    __slots__ = ("lang", "paths")

    def __init__(self, lang: str, paths: list[Path]) -> None:
        self.lang = lang
        self.paths = paths

    def __repr__(self) -> str:
        return f"CorpusSpec({self.lang!r}, {[str(p) for p in self.paths]!r})"


def parse_lang_path(items: list[str]) -> list[CorpusSpec]:
    """Parses ``LANG:PATH`` command-line items into per-language corpora.

    The same language may be given several times; its files are read in the order given.
    """
    by_lang: dict[str, list[Path]] = {}
    for item in items:
        lang, sep, path = item.partition(":")
        if not sep or not lang or not path:
            raise ValueError(
                f"expected LANG:PATH, got {item!r} (for example en:data/mono.en.txt.gz)"
            )
        if not lang.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"invalid language code {lang!r} in {item!r}: use letters, digits, '_'"
            )
        by_lang.setdefault(lang, []).append(Path(path))
    return [CorpusSpec(lang, paths) for lang, paths in by_lang.items()]
