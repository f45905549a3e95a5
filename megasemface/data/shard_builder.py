"""Builds webdataset token shards from monolingual or parallel text, resumably and reproducibly.

The builder streams each language's text once, never holding a corpus in memory: the main
process reads lines in blocks, worker processes clean, hash and encode them with
SentencePiece (``jobs``), and the main process de-duplicates, packs sentences into samples
(see ``shard_format``) and writes shards with ``webdataset.ShardWriter``.

A parallel corpus (``textio.parse_parallel``) goes the same way as one more "language" named
after its pair (``en-de``): its two files are read in lockstep, and each kept pair is one
sentence ``source ids + [eos] + target ids`` (see ``pairs``), so packing, resume, the loader
and batching treat it like any sentence and never split a pair.

Resume: each shard is written under ``.partial/`` and renamed into place when complete,
then recorded in ``.build-journal.jsonl`` with the input line it ends at and the filter
counts so far. Run again with the same arguments after a crash or ``kill -9``, the builder
skips the recorded lines (re-hashing them when de-duplicating, without encoding) and writes
the remaining shards. The output is a deterministic function of the inputs and options, so
a resumed build is byte-identical to an uninterrupted one. ``manifest.json`` is written last
and marks the build complete.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds

from megasemface.data.cleaning import DropReason
from megasemface.data.encoding import EncodedBlock, init_worker, process_block
from megasemface.data.hashset import HashSet
from megasemface.data.shard_format import (
    FORMAT_VERSION,
    ShardInfo,
    encode_sample,
    write_json_atomic,
)
from megasemface.data.textio import (
    AlignmentError,
    CorpusSpec,
    count_lines,
    iter_aligned_blocks,
    split_lines,
)
from megasemface.data.tokenizer import Tokenizer

__all__ = ["ShardBuildConfig", "ShardBuildError", "build_shards", "id_dtype_for"]

JOURNAL = ".build-journal.jsonl"
PARTIAL = ".partial"
_N_REASONS = len(DropReason)


@dataclasses.dataclass(kw_only=True)
class ShardBuildConfig:
    """Options of a shard build; all of them are part of the build's fingerprint."""

    max_chars: int = 2000
    """Lines with more characters than this (after white-space cleaning) are dropped."""
    max_tokens: int = 254
    """Sentences with more tokens are dropped (the paper's length limit 256, less 2 specials);
    pairs with more on either side (so a stored pair has at most 2 x max_tokens + 1)."""
    dedup: bool = False
    """Drop exact duplicate lines (pairs) within a language (pair); 16-32 bytes per distinct
    one."""
    tokens_per_sample: int = 1 << 16
    """A sample closes once it holds this many tokens (about 128 KiB of uint16 ids)."""
    samples_per_shard: int = 256
    """Samples per shard file (about 16M tokens, 32 MiB, per shard by default)."""
    jobs: int = 1
    """Worker processes that clean and encode; 1 works in the main process."""
    bytes_per_task: int = 1 << 18
    """Raw text sent to a worker at a time (cut at line ends)."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_tokens", "tokens_per_sample", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.jobs < 1 or self.bytes_per_task < 1:
            raise ValueError("jobs and bytes_per_task must be >= 1")

    def output_fields(self) -> dict[str, Any]:
        """The options that decide the output bytes (jobs and task size do not)."""
        fields = dataclasses.asdict(self)
        del fields["jobs"], fields["bytes_per_task"]
        return fields


class ShardBuildError(RuntimeError):
    """A shard build cannot proceed; the message says why and what to do."""


def id_dtype_for(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 token ids when the vocabulary allows, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


# --- main side ---------------------------------------------------------------------------


class _Executor:
    """Runs process_block in order, inline or on a pool with a bounded number in flight."""

    def __init__(self, jobs: int, model_proto: bytes) -> None:
        self._pool = None
        if jobs > 1:
            # fork starts workers in milliseconds; spawn would re-import torch (through
            # webdataset) in each worker. The pool is made before any thread is started.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            self._pool = ctx.Pool(jobs, initializer=init_worker, initargs=(model_proto,))
        else:
            init_worker(model_proto)
        self._in_flight = 2 * jobs

    def map(self, blocks: Iterable[tuple[Any, ...]]) -> Iterator[EncodedBlock]:
        """process_block over argument tuples, results in order."""
        if self._pool is None:
            for args in blocks:
                yield process_block(*args)
            return
        pending: collections.deque[Any] = collections.deque()
        for args in blocks:
            pending.append(self._pool.apply_async(process_block, args))
            if len(pending) >= self._in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


def _input_fingerprint(corpus: CorpusSpec) -> list[dict[str, Any]]:
    """Identifies each input by its size and the sha256 of its first and last MiB.

    Cheap for any corpus size, independent of timestamps (a regenerated identical file is
    the same input), and still catches appended, truncated or replaced files.
    """
    out = []
    for path in corpus.all_paths:
        if not path.is_file():
            raise ShardBuildError(f"{corpus.lang}: corpus file not found: {path}")
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(size - (1 << 20))
            digest.update(handle.read(1 << 20))
        out.append({"path": str(path), "size": size, "ends_sha256": digest.hexdigest()})
    return out


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Journal:
    """Append-only record of completed shards and languages; survives kill -9."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.entries: list[dict[str, Any]] = []
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()
            records = []
            for i, line in enumerate(lines):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    if i != len(lines) - 1:  # only the last line may be cut by a kill
                        raise ShardBuildError(f"{path}: line {i + 1} is corrupt") from None
            if not records or records[0].get("fingerprint") != fingerprint:
                raise ShardBuildError(
                    f"{path.parent} holds an unfinished build with other inputs or options; "
                    "rerun with the original arguments, or pass --overwrite to start again"
                )
            self.entries = records[1:]
        else:
            self._append({"fingerprint": fingerprint})

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def add(self, record: dict[str, Any]) -> None:
        self._append(record)
        self.entries.append(record)

    def shards(self, lang: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e.get("kind") == "shard" and e["shard"]["lang"] == lang]

    def language_done(self, lang: str) -> dict[str, Any] | None:
        for entry in self.entries:
            if entry.get("kind") == "language" and entry["lang"] == lang:
                return entry
        return None


class _LanguageBuild:
    """Builds (or resumes) the shards of one language, or of one language pair."""

    def __init__(
        self,
        corpus: CorpusSpec,
        out_dir: Path,
        config: ShardBuildConfig,
        journal: _Journal,
        executor: _Executor,
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

    # Input ------------------------------------------------------------------------------

    def _blocks(
        self, reader_progress: Callable[[int], None]
    ) -> Iterator[tuple[int, tuple[bytes, ...]]]:
        """Yields (first line index, raw blocks of the same whole lines of each aligned file).

        One file at a time for a language, a (source, target) pair of files for a pair.
        """
        index = 0
        for group in self.corpus.file_groups:
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
            reader_progress(-1)

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
            sha256=_sha256_file(partial),
        )
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, final)
        _fsync_dir(self.out_dir)
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
                "the language, or raise --max-chars / --max-tokens"
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


def _pair_layouts(
    corpora: list[CorpusSpec], tokenizer: Tokenizer, spm_model: Path, config: ShardBuildConfig
) -> dict[str, dict[str, Any]]:
    """How each parallel corpus is stored, as the manifest records it under ``pair``.

    Pairs are joined with the tokenizer's eos id, which SentencePiece encoding never
    produces, so the split is unambiguous; each language of a pair needs a tag in the model,
    which translation training puts before the sentences.
    """
    layouts = {}
    for corpus in corpora:
        if corpus.pair is None:
            continue
        missing = [lang for lang in corpus.pair if lang not in tokenizer.languages]
        if missing:
            raise ShardBuildError(
                f"pair {corpus.lang}: the SentencePiece model {spm_model} has no language tag "
                f"for {', '.join(missing)} (its languages: {', '.join(tokenizer.languages)}); "
                "fix the pair name or train a model with these languages"
            )
        try:
            separator = tokenizer.eos_id
        except ValueError as exc:
            raise ShardBuildError(f"{spm_model}: {exc}, which separates pairs") from exc
        layouts[corpus.lang] = {
            "src": corpus.pair[0],
            "tgt": corpus.pair[1],
            "separator_id": separator,
            "max_length": 2 * config.max_tokens + 1,
        }
    return layouts


def _build_fingerprint(
    corpora: list[CorpusSpec],
    spm_sha256: str,
    config: ShardBuildConfig,
    pairs: dict[str, dict[str, Any]],
) -> tuple[str, dict[str, Any]]:
    described = {
        "format_version": FORMAT_VERSION,
        "spm_sha256": spm_sha256,
        "config": config.output_fields(),
        "inputs": {c.lang: _input_fingerprint(c) for c in corpora},
    }
    if pairs:  # absent otherwise, so that builds without pairs keep their fingerprint
        described["pairs"] = pairs
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return digest, described


def build_shards(
    corpora: list[CorpusSpec],
    spm_model: Path,
    out_dir: Path,
    config: ShardBuildConfig,
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Builds (or completes, or confirms) the shards of every corpus; returns the manifest."""
    if not corpora:
        raise ShardBuildError("no input corpora given")
    spm_model = Path(spm_model)
    if not spm_model.is_file():
        raise ShardBuildError(f"SentencePiece model not found: {spm_model}")
    names = [corpus.lang for corpus in corpora]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ShardBuildError(
            f"{', '.join(repeated)} given more than once; give all files of a language (or "
            "pair) in one CorpusSpec"
        )
    model_proto = spm_model.read_bytes()
    try:
        tokenizer = Tokenizer.from_bytes(model_proto)
    except ValueError as exc:
        raise ShardBuildError(f"{spm_model}: {exc}") from exc
    vocab_size = tokenizer.vocab_size
    pairs = _pair_layouts(corpora, tokenizer, spm_model, config)
    # Languages never join sides, so any id would do for them.
    separator = tokenizer.eos_id if pairs else -1
    spm_sha256 = tokenizer.sha256
    fingerprint, described = _build_fingerprint(corpora, spm_sha256, config, pairs)

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        existing = json.loads(manifest_path.read_text(encoding="utf-8"))
        if existing.get("build_fingerprint") == fingerprint:
            existing["already_built"] = True
            return existing
        if not overwrite:
            raise ShardBuildError(
                f"{out_dir} already holds shards built from other inputs or options; "
                "choose another output directory or pass --overwrite"
            )
    if overwrite:
        _remove_build(out_dir)
    (out_dir / PARTIAL).mkdir(exist_ok=True)
    for stale in (out_dir / PARTIAL).iterdir():
        stale.unlink()
    journal = _Journal(out_dir / JOURNAL, fingerprint)
    dtype = id_dtype_for(vocab_size)
    executor = _Executor(config.jobs, model_proto)
    try:
        for corpus in corpora:
            if journal.language_done(corpus.lang) is None:
                build = _LanguageBuild(
                    corpus, out_dir, config, journal, executor, dtype, separator, progress
                )
                journal.add(build.run())
    finally:
        executor.close()
    manifest = _manifest(journal, corpora, described, fingerprint, vocab_size, spm_model, dtype)
    write_json_atomic(manifest_path, manifest)
    (out_dir / JOURNAL).unlink()
    shutil.rmtree(out_dir / PARTIAL, ignore_errors=True)
    return manifest


def _remove_build(out_dir: Path) -> None:
    """Removes what an earlier build wrote (its shards, journal, manifest), nothing else."""
    for path in [*out_dir.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].tar"), out_dir / JOURNAL]:
        path.unlink(missing_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(out_dir / PARTIAL, ignore_errors=True)


def _manifest(
    journal: _Journal,
    corpora: list[CorpusSpec],
    described: dict[str, Any],
    fingerprint: str,
    vocab_size: int,
    spm_model: Path,
    dtype: type[np.unsignedinteger],
) -> dict[str, Any]:
    shards = [e["shard"] for e in journal.entries if e.get("kind") == "shard"]
    languages = {}
    for corpus in corpora:
        done = journal.language_done(corpus.lang)
        assert done is not None
        mine = [s for s in shards if s["lang"] == corpus.lang]
        languages[corpus.lang] = {
            "inputs": [str(p) for p in corpus.paths],
            "lines": done["lines"],
            "sentences": sum(s["sentences"] for s in mine),
            "tokens": sum(s["tokens"] for s in mine),
            "shards": len(mine),
            "filtered": {k: v for k, v in done["counts"].items() if k != "kept"},
        }
        if corpus.pair is not None:
            # For a pair, lines and sentences count pairs, and tokens include separators.
            languages[corpus.lang]["inputs"] = [[str(p) for p in g] for g in corpus.file_groups]
            languages[corpus.lang]["pair"] = described["pairs"][corpus.lang]
    total_tokens = sum(s["tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    return {
        "format_version": FORMAT_VERSION,
        "build_fingerprint": fingerprint,
        "spm": {
            "sha256": described["spm_sha256"],
            "vocab_size": vocab_size,
            "file": spm_model.name,
        },
        "id_dtype": np.dtype(dtype).name,
        "config": described["config"],
        "languages": languages,
        "shards": shards,
        "totals": {
            "shards": len(shards),
            "sentences": sum(s["sentences"] for s in shards),
            "tokens": total_tokens,
            "bytes": total_bytes,
            "bytes_per_token": round(total_bytes / max(total_tokens, 1), 4),
        },
    }
