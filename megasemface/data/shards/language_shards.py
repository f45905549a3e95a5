"""Building the shards of one language (or language pair): encoding, packing and writing.

Blocks of raw lines go through the encoding workers in order; kept sentences are
de-duplicated, packed into samples of about ``tokens_per_sample`` tokens and written with
``webdataset.ShardWriter`` under ``.partial/``. A complete shard is fsynced, renamed into the
output directory and recorded in the build journal; on resume the recorded lines are skipped
(re-hashed only when de-duplicating).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds

from megasemface.data.shards.encoding import EncodedBlock, EncodingPool
from megasemface.data.shards.shard_build_config import ShardBuildConfig, ShardBuildError
from megasemface.data.shards.shard_format import ShardInfo, encode_sample
from megasemface.data.shards.shard_journal import BuildJournal
from megasemface.data.text.cleaning import DropReason
from megasemface.data.text.hashset import HashSet
from megasemface.data.text.textio import (
    AlignmentError,
    CorpusReadError,
    CorpusSpec,
    count_lines,
    iter_aligned_blocks,
    split_lines,
    warn_invalid_utf8,
)
from megasemface.files import file_sha256, fsync_directory

__all__ = ["PARTIAL", "LanguageShardBuild"]

PARTIAL = ".partial"
"""The directory, in the output directory, of the shards being written."""
_N_REASONS = len(DropReason)


class LanguageShardBuild:
    """Builds (or resumes) the shards of one language, or of one language pair."""

    def __init__(
        self,
        corpus: CorpusSpec,
        out_dir: Path,
        config: ShardBuildConfig,
        journal: BuildJournal,
        executor: EncodingPool,
        dtype: type[np.unsignedinteger],
        separator: int,
        progress: bool,
    ) -> None:
        self.corpus = corpus
        self.lang = corpus.lang
        self.out_dir = out_dir
        self.config = config
        self.journal = journal
        self.executor = executor
        self.dtype = dtype
        self.separator = separator
        self.progress = progress
        done = journal.shards(self.lang)
        self.next_shard = len(done)
        self.resume_line = done[-1]["end_line"] if done else 0
        self.counts = np.array(
            [done[-1]["counts"][r.label] for r in DropReason] if done else [0] * _N_REASONS,
            dtype=np.int64,
        )
        # Distinct text lines before the resume point, to check the replayed prefix against.
        self.resume_distinct = int(
            self.counts[DropReason.KEPT] + self.counts[DropReason.TOO_LONG_TOKENS]
        )
        self.hashes = HashSet() if config.dedup else None
        self.writer: wds.ShardWriter | None = None
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.pending_tokens = 0
        self.samples_written = 0
        self.shard_sentences = 0
        self.shard_tokens = 0
        self.last_sample_end: dict[str, Any] = {}
        self.file_starts: list[int] = []
        """The language's line index at which each file (or pair of files) starts."""
        self.named_files: set[int] = set()
        """The files (by group) whose first invalid UTF-8 line has been named."""

    # Input ------------------------------------------------------------------------------

    def _blocks(
        self, reader_progress: Callable[[int], None]
    ) -> Iterator[tuple[int, tuple[bytes, ...]]]:
        """Yields (first line index, raw blocks of the same whole lines of each aligned file).

        One file at a time for a language, a (source, target) pair of files for a pair.
        """
        index = 0
        for group in self.corpus.file_groups:
            self.file_starts.append(index)
            try:
                for sides, position in iter_aligned_blocks(group, self.config.bytes_per_task):
                    yield index, sides
                    index += count_lines(sides[0])
                    reader_progress(position)
            except AlignmentError as exc:
                raise ShardBuildError(
                    f"{self.lang}: {exc}. Nothing of this build is marked complete; once the "
                    "files are fixed, run it again with --overwrite"
                ) from exc
            except CorpusReadError as exc:  # it names the file and the last line read whole
                raise ShardBuildError(f"{self.lang}: {exc}") from None
            reader_progress(-1)

    def _name_invalid_utf8(self, start: int, statuses: np.ndarray) -> None:
        """Names each file's first invalid UTF-8 line as the build meets it (they are dropped
        and counted: a count in the summary of an hour-long build says neither where nor
        which file)."""
        bad = np.flatnonzero(statuses == DropReason.INVALID_UTF8)
        if not len(bad):
            return
        for line in (start + bad).tolist():
            group = bisect.bisect_right(self.file_starts, line) - 1
            if group not in self.named_files:
                self.named_files.add(group)
                files = ",".join(str(p) for p in self.corpus.file_groups[group])
                warn_invalid_utf8(files, line - self.file_starts[group] + 1)

    # Output -----------------------------------------------------------------------------

    def _on_shard_closed(self, partial_name: str) -> None:
        partial = Path(partial_name)
        final = self.out_dir / partial.name
        info = ShardInfo(
            name=final.name,
            lang=self.lang,
            samples=self.samples_written - self.next_shard_first_sample,
            sentences=self.shard_sentences,
            tokens=self.shard_tokens,
            bytes=partial.stat().st_size,
            sha256=file_sha256(partial),
        )
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, final)
        fsync_directory(self.out_dir)
        self.journal.add(
            {"kind": "shard", "shard": dataclasses.asdict(info), **self.last_sample_end}
        )
        self.next_shard += 1
        self.next_shard_first_sample = self.samples_written
        self.shard_sentences = 0
        self.shard_tokens = 0

    def _write_sample(self, tokens: np.ndarray, lengths: np.ndarray, end: dict[str, Any]) -> None:
        if self.writer is None:
            self.next_shard_first_sample = 0
            self.writer = wds.ShardWriter(
                str(self.out_dir / PARTIAL / f"{self.lang}-%06d.tar"),
                maxcount=self.config.samples_per_shard,
                maxsize=float("inf"),
                post=self._on_shard_closed,
                start_shard=self.next_shard,
                verbose=0,
                encoder=False,
                mtime=0.0,  # fixed timestamps: the same input gives the same bytes
            )
        sample_in_shard = (self.samples_written - self.next_shard_first_sample) % (
            self.config.samples_per_shard
        )
        shard = self.next_shard + (
            (self.samples_written - self.next_shard_first_sample) // self.config.samples_per_shard
        )
        first_sentence = self.shard_sentences if sample_in_shard else 0
        key = f"{self.lang}-{shard:06d}-{sample_in_shard:06d}"
        # ShardWriter closes the previous shard (calling _on_shard_closed) inside write(),
        # before this sample is counted, so the journal gets the previous sample's end.
        self.writer.write(encode_sample(key, self.lang, tokens, lengths, first_sentence))
        self.samples_written += 1
        self.shard_sentences += len(lengths)
        self.shard_tokens += len(tokens)
        self.last_sample_end = end

    def _emit(self, tokens: np.ndarray, lengths: np.ndarray, end: dict[str, Any]) -> None:
        pieces = [*self.pending, (tokens, lengths)]
        self.pending, self.pending_tokens = [], 0
        self._write_sample(
            np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]), end
        )

    def _add_sentences(
        self, tokens: np.ndarray, lengths: np.ndarray, lines: np.ndarray, counts_at: Callable
    ) -> None:
        """Packs kept sentences into samples; ``counts_at(i)`` gives counts up to line i."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        start = 0
        while start < len(lengths):
            need = self.config.tokens_per_sample - self.pending_tokens
            stop = int(np.searchsorted(offsets, offsets[start] + need, side="left"))
            if stop > len(lengths):
                self.pending.append(
                    (tokens[offsets[start] :], lengths[start:].astype(np.int64, copy=False))
                )
                self.pending_tokens += int(offsets[-1] - offsets[start])
                return
            stop = max(stop, start + 1)
            end = {"end_line": int(lines[stop - 1]) + 1, "counts": counts_at(lines[stop - 1])}
            self._emit(tokens[offsets[start] : offsets[stop]], lengths[start:stop], end)
            start = stop

    # Driver -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        except BaseException:
            if self.writer is not None:
                # Abandon the shard being written: it stays in .partial/, unrecorded, and the
                # next run starts again after the last recorded shard.
                self.writer.post = None
                self.writer.close()
            raise

    def _run(self) -> dict[str, Any]:
        cfg = self.config
        total_bytes = sum(p.stat().st_size for p in self.corpus.all_paths)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"shards {self.lang}")
        done_bytes = [0, 0]  # finished files, position in the current file

        def report(position: int) -> None:
            if position < 0:
                done_bytes[0] += done_bytes[1]
                done_bytes[1] = 0
            else:
                done_bytes[1] = position
            if bar is not None:
                bar.update(done_bytes[0] + done_bytes[1] - bar.n)

        started, kept_since_start = time.perf_counter(), 0

        def task(start: int, sides: tuple[Any, ...]) -> tuple[int, tuple[Any, ...]]:
            encode = start >= self.resume_line  # lines before it are only re-hashed
            return start, (sides, cfg.max_chars, cfg.dedup, encode, self.dtype, self.separator)

        tasks = (task(*block) for block in self._split_at_resume(self._blocks(report)))
        starts: collections.deque[int] = collections.deque()

        def args_only() -> Iterator[tuple[Any, ...]]:
            for start, args in tasks:
                starts.append(start)
                yield args

        rebuilt = 0
        for result in self.executor.map(args_only()):
            start = starts.popleft()
            if start < self.resume_line:
                rebuilt += self._replay(result)
                continue
            kept_since_start += self._consume(start, result)
            if bar is not None:
                rate = kept_since_start / max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} sent/s")
        if bar is not None:
            bar.close()
        if self.hashes is not None and self.resume_line:
            expected = self.resume_distinct
            if rebuilt != expected:
                raise ShardBuildError(
                    f"{self.lang}: the input changed since the interrupted build "
                    f"({rebuilt} distinct lines before line {self.resume_line}, journal says "
                    f"{expected}); pass --overwrite to rebuild from scratch"
                )
        if self.pending:
            tokens = np.concatenate([p[0] for p in self.pending])
            lengths = np.concatenate([p[1] for p in self.pending])
            self.pending, self.pending_tokens = [], 0
            self._write_sample(tokens, lengths, {"end_line": -1, "counts": {}})
        if self.writer is not None:
            self.last_sample_end = {"end_line": self.total_lines, "counts": self.counts_dict()}
            self.writer.close()
        counts = self.counts_dict()
        if counts["kept"] == 0:
            raise ShardBuildError(
                f"{self.lang}: no sentence kept from {[str(p) for p in self.corpus.all_paths]} "
                f"(dropped: { {k: v for k, v in counts.items() if v} }); check the files and "
                "the language, or raise --max-chars / --max-sentence-tokens"
            )
        return {"kind": "language", "lang": self.lang, "lines": self.total_lines, "counts": counts}

    def counts_dict(self) -> dict[str, int]:
        return {reason.label: int(self.counts[reason]) for reason in DropReason}

    def _split_at_resume(
        self, blocks: Iterator[tuple[int, tuple[bytes, ...]]]
    ) -> Iterator[tuple[int, tuple[bytes, ...] | tuple[list[bytes], ...]]]:
        """Cuts the block that straddles the resume line in two; skips the prefix cheaply.

        Lines before the resume line are only needed to re-hash them when de-duplicating.
        """
        self.total_lines = 0
        for start, sides in blocks:
            end = start + count_lines(sides[0])
            self.total_lines = end
            if end <= self.resume_line:
                if self.hashes is not None:
                    yield start, sides
            elif start < self.resume_line:
                lines = [split_lines(side) for side in sides]
                cut = self.resume_line - start
                if self.hashes is not None:
                    yield start, tuple(side[:cut] for side in lines)
                yield self.resume_line, tuple(side[cut:] for side in lines)
            else:
                yield start, sides

    def _replay(self, result: EncodedBlock) -> int:
        """Re-inserts the hashes of lines written before an interruption."""
        assert self.hashes is not None and result.hashes is not None
        return int(self.hashes.insert(result.hashes).sum())

    def _consume(self, start: int, result: EncodedBlock) -> int:
        assert result.tokens is not None and result.lengths is not None
        assert result.longest_side is not None
        self._name_invalid_utf8(start, result.statuses)
        final = result.statuses.copy()
        keep = np.ones(len(result.kept), dtype=bool)
        if self.hashes is not None:
            assert result.hashes is not None
            keep = self.hashes.insert(result.hashes)
            final[result.kept[~keep]] = DropReason.DUPLICATE
        too_long = result.longest_side > self.config.max_tokens
        final[result.kept[keep & too_long]] = DropReason.TOO_LONG_TOKENS
        keep &= ~too_long
        tokens = result.tokens[np.repeat(keep, result.lengths)]
        lengths = result.lengths[keep]
        lines = start + result.kept[keep]
        before = self.counts.copy()

        def counts_at(line: int) -> dict[str, int]:
            upto = np.bincount(final[: int(line) - start + 1], minlength=_N_REASONS)
            return {r.label: int(before[r] + upto[r]) for r in DropReason}

        self.counts += np.bincount(final, minlength=_N_REASONS)
        self._add_sentences(tokens, lengths, lines, counts_at)
        return int(keep.sum())
