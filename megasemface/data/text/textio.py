"""Streaming access to plain or compressed text corpora.

Corpora are read as bytes, one line at a time, so that an invalid UTF-8 line can be
counted and dropped instead of failing the whole file, and so that memory stays flat
whatever the corpus size.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import itertools
import logging
import lzma
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "AlignmentError",
    "CorpusReadError",
    "CorpusSpec",
    "LineReader",
    "count_lines",
    "iter_aligned_blocks",
    "iter_lines",
    "parse_lang_path",
    "parse_parallel",
    "split_lines",
    "warn_invalid_utf8",
]

logger = logging.getLogger(__name__)

_BUFFER = 1 << 20


class CorpusReadError(ValueError):
    """A corpus file cannot be read to its end: truncated or damaged compressed data, or a
    read error of the disk. The message names the file and how far reading got."""


def _decompression_errors() -> tuple[type[BaseException], ...]:
    """What the decompressors raise for damaged or truncated input (zstandard's only when it
    is installed: it is imported for .zst corpora alone)."""
    errors: list[type[BaseException]] = [EOFError, OSError, lzma.LZMAError, zlib.error]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    return tuple(errors)


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, one after another.

    Read through ``decompressobj`` rather than zstandard's ``stream_reader``, which returns
    the data of a file cut inside a frame without an error: here the end of the file inside a
    frame raises ``EOFError``, as gzip, bz2 and xz do.
    """

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard  # imported only when a .zst corpus is read

        self._raw = raw
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._in_frame = False
        self._pending = b""
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._offset == len(self._pending):
            data = self._raw.read(_BUFFER)
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd stream ended inside a frame")
                return 0
            self._pending, self._offset = self._decompress(data), 0
        size = min(len(buffer), len(self._pending) - self._offset)
        buffer[:size] = self._pending[self._offset : self._offset + size]
        self._offset += size
        return size

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame.eof:  # the next frame starts in what the last one left
                self._frame = self._context.decompressobj()
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)


class LineReader:
    """Reads a plain or compressed corpus file line by line, as bytes.

    Supported: plain text, ``.gz``, ``.bz2``, ``.xz`` and ``.zst``. ``compressed_bytes_read``
    reports the position in the file on disk, which gives a progress bar and an ETA for
    compressed input whose line count is unknown in advance. ``lines_read`` counts the lines
    handed out, so that damage found deep inside a large file is reported with the last line
    read whole, the place a user can look at (``zcat FILE | sed -n LINEp``).

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
            stream = io.BufferedReader(_ZstdFrames(self._raw), buffer_size=_BUFFER)
        else:
            stream = self._raw
        self._stream = stream
        self.lines_read = 0
        """Lines handed out so far (by iteration, blocks or ``read_lines``)."""

    @property
    def compressed_bytes_read(self) -> int:
        return self._raw.tell()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Turns a decompressor's or the disk's error into a :class:`CorpusReadError`."""
        try:
            yield
        except _decompression_errors() as exc:
            done = f"{self._raw.tell():,} of {self.size_on_disk:,} bytes"
            raise CorpusReadError(
                f"{self.path}: cannot read the file past line {self.lines_read:,} ({done}): "
                f"{exc}; the file is truncated or damaged: copy or compress it again (gzip, "
                "bzip2, xz and zstd check a file with -t)"
            ) from None

    def __iter__(self) -> Iterator[bytes]:
        with self._reading():
            for line in self._stream:
                # Less than a second over 50M lines, and an error then knows how far it got.
                self.lines_read += 1
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
        with self._reading():
            while data := self._stream.read(size):
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # no line end in this read: a line longer than size
                    carry += data
                    continue
                block = carry + data[:cut]
                self.lines_read += count_lines(block)
                yield block
                carry = data[cut:]
        if carry:
            self.lines_read += 1
            yield carry

    def read_lines(self, count: int) -> tuple[bytes, int]:
        """Reads the next ``count`` lines as one block; returns it and how many lines it has.

        Fewer lines come back only at the end of the file. Lines are read by the buffered
        reader in C, one call each, so following another file's blocks line for line stays
        cheap.
        """
        with self._reading():
            lines = list(itertools.islice(iter(self._stream.readline, b""), count))
        self.lines_read += len(lines)
        return b"".join(lines), len(lines)

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


class AlignmentError(ValueError):
    """Line-aligned files (the two sides of a parallel corpus) have different line counts."""


def iter_aligned_blocks(
    paths: Sequence[Path], size: int
) -> Iterator[tuple[tuple[bytes, ...], int]]:
    """Yields blocks holding the same lines of line-aligned files, and the bytes read so far.

    The first file is cut into blocks of about ``size`` bytes at line ends (as
    ``LineReader.iter_blocks`` cuts it) and every other file gives the same number of lines,
    so a block's sides are the same sentences in each file; one file is read exactly as
    ``iter_blocks`` reads it. The second value is the position on disk summed over the files,
    for progress. Files whose line counts differ raise AlignmentError once the shorter one
    ends, naming both files and the shorter one's line count.
    """
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(LineReader(path)) for path in paths]
        first, others = readers[0], readers[1:]
        lines = 0
        for block in first.iter_blocks(size):
            count = count_lines(block)
            sides = [block]
            for reader in others:
                side, got = reader.read_lines(count)
                if got < count:
                    raise _misaligned(first.path, reader.path, reader.path, lines + got)
                sides.append(side)
            lines += count
            yield tuple(sides), sum(r.compressed_bytes_read for r in readers)
        for reader in others:
            if reader.read_lines(1)[1]:
                raise _misaligned(first.path, reader.path, first.path, lines)


def _misaligned(a: Path, b: Path, shorter: Path, lines: int) -> AlignmentError:
    return AlignmentError(
        f"{a} and {b} are not line-aligned: {shorter} ends after line {lines:,} while the "
        "other file goes on. A parallel corpus needs line i of one file to translate line i "
        "of the other: fix or replace the files"
    )


def warn_invalid_utf8(path: str | os.PathLike[str], line: int) -> None:
    """Names the first line of a corpus file that is not UTF-8, as soon as it is met.

    Such lines are dropped and counted, not fatal, but a count alone in the final report of
    a 50M-line run leaves the user to hunt for them; the reading code calls this once per
    file, for the first one. Reading processes without a logging set-up print it to stderr
    all the same (Python's last-resort handler takes warnings).
    """
    logger.warning(
        "%s:%d: not valid UTF-8: the line is skipped, and later such lines of this file are "
        "counted, not named; convert the file (e.g. iconv -f latin1 -t utf-8) to keep them",
        path,
        line,
    )


def iter_lines(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Yields the lines of a plain or compressed corpus file as bytes (see LineReader)."""
    with LineReader(path) as reader:
        yield from reader


class CorpusSpec:
    """One language's corpus, or one language pair's parallel corpus.

    A language's corpus is its code and one or more files read in order. A parallel corpus
    is named after its pair (``en-de``), has ``pair`` = (source, target), source files in
    ``paths`` and the line-aligned target files, one per source file, in ``target_paths``.
    """

    __slots__ = ("lang", "pair", "paths", "target_paths")

    def __init__(
        self,
        lang: str,
        paths: list[Path],
        *,
        pair: tuple[str, str] | None = None,
        target_paths: list[Path] | None = None,
    ) -> None:
        if (pair is None) != (target_paths is None):
            raise ValueError("a parallel corpus needs both pair and target_paths")
        if target_paths is not None and len(target_paths) != len(paths):
            raise ValueError(
                f"{lang}: {len(paths)} source file(s) but {len(target_paths)} target file(s)"
            )
        self.lang = lang
        self.pair = pair
        self.paths = paths
        self.target_paths = target_paths

    @property
    def file_groups(self) -> list[tuple[Path, ...]]:
        """The files read together: each file alone, or each (source, target) pair of files."""
        if self.target_paths is None:
            return [(path,) for path in self.paths]
        return list(zip(self.paths, self.target_paths, strict=True))

    @property
    def all_paths(self) -> list[Path]:
        """Every file, in reading order (a source file before its target file)."""
        return [path for group in self.file_groups for path in group]

    def __repr__(self) -> str:
        files = [[str(p) for p in group] for group in self.file_groups]
        if self.pair is None:
            return f"CorpusSpec({self.lang!r}, {[f[0] for f in files]!r})"
        return f"CorpusSpec({self.lang!r}, pair={self.pair!r}, files={files!r})"


def _check_lang(lang: str, item: str) -> None:
    if not lang.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid language code {lang!r} in {item!r}: use letters, digits, '_'")


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
        _check_lang(lang, item)
        by_lang.setdefault(lang, []).append(Path(path))
    return [CorpusSpec(lang, paths) for lang, paths in by_lang.items()]


def parse_parallel(items: list[str]) -> list[CorpusSpec]:
    """Parses ``SRC-TGT:SRC_PATH,TGT_PATH`` command-line items into parallel corpora.

    The two files are line-aligned (line i of one translates line i of the other). The same
    pair may be given several times; its file pairs are read in the order given. The pair
    name has exactly one '-', so codes in a pair cannot contain one (write zh_Hant).
    """
    by_pair: dict[tuple[str, str], list[tuple[Path, Path]]] = {}
    for item in items:
        name, sep, files = item.partition(":")
        src_path, comma, tgt_path = files.partition(",")
        if not sep or not comma or not src_path or not tgt_path or "," in tgt_path:
            raise ValueError(
                f"expected SRC-TGT:SRC_PATH,TGT_PATH, got {item!r} "
                "(for example en-de:corpus/train.en,corpus/train.de)"
            )
        langs = name.split("-")
        if len(langs) != 2 or not all(langs):
            raise ValueError(
                f"invalid pair name {name!r} in {item!r}: write SRC-TGT with one '-', e.g. "
                "en-de (codes in a pair use '_' instead of '-')"
            )
        for lang in langs:
            _check_lang(lang, item)
        if langs[0] == langs[1]:
            raise ValueError(f"pair {name!r} in {item!r} needs two different languages")
        by_pair.setdefault((langs[0], langs[1]), []).append((Path(src_path), Path(tgt_path)))
    return [
        CorpusSpec(
            f"{src}-{tgt}",
            [path for path, _ in files],
            pair=(src, tgt),
            target_paths=[path for _, path in files],
        )
        for (src, tgt), files in by_pair.items()
    ]
