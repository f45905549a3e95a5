"""Joint SentencePiece training over several monolingual corpora, and the project's tokenizer.

Training (:func:`train_spm`) works in three steps, so that memory stays bounded by
``max_sentences_per_lang`` per language whatever the corpus size (up to tens of millions of
lines per language):

1. each language's files are streamed once; a seeded reservoir sample keeps at most
   ``max_sentences_per_lang`` usable lines while every line is counted
   (:func:`reservoir_sample`);
2. the training budget (the sum of the reservoir sizes) is split between languages with
   XLM-style temperature sampling over the *full* line counts (:func:`compute_quotas`); a
   language whose quota exceeds its sample is up-sampled by cycling through it
   (:func:`balanced_sentences`), so small languages really get their larger share;
3. SentencePiece is trained on that stream with byte fallback, the fixed special ids below,
   ``<mask>`` and one control symbol per language.

Vocabulary layout of every model trained here::

    0 <unk>   1 <s>   2 </s>   3 <pad>   4 <mask>   5.. __xx__ (one per language, in the
    order given)   then extra control symbols, the 256 byte pieces, the learned pieces.

Determinism: the same corpora, config and seed give a byte-identical ``.model``. SentencePiece
stores its trainer options, ``num_threads`` included, inside the model, so the bytes (and the
sha256) also depend on ``num_threads``. With BPE the learned pieces do not depend on the thread
count (checked for 1, 2, 4 and 8 threads); with unigram the EM sums are split per thread and
the pieces may differ between thread counts, while still being reproducible for a fixed count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from megasemface.data.languages import lang_from_tag, lang_tag, temperature_probs
from megasemface.data.textio import CorpusSpec, iter_lines
from megasemface.files import atomic_write_bytes, atomic_write_text

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MASK_ID",
    "MASK_PIECE",
    "PAD_ID",
    "UNK_ID",
    "CorpusReadError",
    "LanguageSample",
    "SpmTrainConfig",
    "Tokenizer",
    "balanced_sentences",
    "compute_quotas",
    "reservoir_sample",
    "train_spm",
]

logger = logging.getLogger(__name__)

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_ID = 3
MASK_ID = 4
MASK_PIECE = "<mask>"

MODEL_TYPES = ("bpe", "unigram")
REPORT_FORMAT = "megasemface-spm/1"

# Pieces SentencePiece always reserves before learning anything: unk/bos/eos/pad, plus the
# 256 byte pieces that byte_fallback adds.
_NUM_SPECIAL = 4
_NUM_BYTE_PIECES = 256
# SentencePiece rejects num_threads outside [1, 1024] and a seed equal to uint32 max (its
# "unset" marker).
_MAX_SPM_THREADS = 1024
_MAX_SEED = 2**32 - 2
# SentencePiece skips training lines longer than max_sentence_length *bytes* (default 4192)
# with only a log line; UTF-8 needs at most 4 bytes a character, so this keeps every line
# that passed our own character limit.
_SPM_DEFAULT_MAX_SENTENCE_BYTES = 4192


def _default_threads() -> int:
    return os.cpu_count() or 1


@dataclass(kw_only=True)
class SpmTrainConfig:
    """Options for :func:`train_spm`. Invalid values raise ValueError on construction."""

    vocab_size: int = 60000
    """Total vocabulary size, special, control and byte pieces included (the paper's joint BPE
    uses 60k)."""

    model_type: str = "bpe"
    """``"bpe"`` or ``"unigram"``."""

    character_coverage: float = 0.9995
    """Share of characters covered by character pieces; rarer characters fall back to UTF-8
    bytes. SentencePiece accepts [0.98, 1]."""

    max_sentences_per_lang: int = 1_000_000
    """Reservoir size per language: bounds the lines held in memory and the training budget."""

    temperature: float = 2.0
    """Language sampling temperature over line counts: share ~ count ** (1 / temperature);
    2.0 is XLM's alpha = 0.5, 1.0 keeps raw proportions."""

    seed: int = 0
    """Seeds the reservoir samples, the up-sampling order and SentencePiece's generator."""

    num_threads: int = field(default_factory=_default_threads)
    """SentencePiece trainer threads, and processes for reading corpora (one per language)."""

    max_sentence_chars: int = 2000
    """Lines longer than this (in characters) are skipped while sampling, and counted."""

    extra_control_symbols: tuple[str, ...] = ()
    """Further control symbols, placed after ``<mask>`` and the language tags."""

    verbose: bool = False
    """Let SentencePiece log its progress (INFO) on stderr; otherwise warnings only."""

    def __post_init__(self) -> None:
        self.extra_control_symbols = tuple(self.extra_control_symbols)
        _check_int("vocab_size", self.vocab_size, minimum=1)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if not 0.98 <= self.character_coverage <= 1.0:
            raise ValueError(
                f"character_coverage must be in [0.98, 1.0], got {self.character_coverage}"
            )
        _check_int("max_sentences_per_lang", self.max_sentences_per_lang, minimum=1)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        _check_int("seed", self.seed, minimum=0, maximum=_MAX_SEED)
        _check_int("num_threads", self.num_threads, minimum=1, maximum=_MAX_SPM_THREADS)
        _check_int("max_sentence_chars", self.max_sentence_chars, minimum=1)
        reserved = {"<unk>", "<s>", "</s>", "<pad>", MASK_PIECE}
        seen: set[str] = set()
        for symbol in self.extra_control_symbols:
            if not isinstance(symbol, str) or not symbol or any(c.isspace() for c in symbol):
                raise ValueError(f"control symbols must be non-empty, without spaces: {symbol!r}")
            if symbol in reserved or symbol in seen:
                raise ValueError(f"control symbol {symbol!r} is reserved or given twice")
            # Tokenizer.languages reads language tags back from the control pieces, so an
            # extra symbol shaped like a tag would be taken for a language.
            if lang_from_tag(symbol) is not None:
                raise ValueError(
                    f"control symbol {symbol!r} looks like a language tag ({lang_tag('xx')}); "
                    "pick another name"
                )
            seen.add(symbol)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    # bool is an int subclass; True as a vocabulary size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


# --------------------------------------------------------------------------------------------
# Sampling


class CorpusReadError(ValueError):
    """A corpus file could not be read or decompressed (truncated archive, I/O error...)."""


@dataclass
class LanguageSample:
    """The reservoir sample of one language, with the counts of what was read."""

    lang: str
    paths: list[str]
    lines: list[bytes]
    """At most ``capacity`` usable lines (valid UTF-8, not blank, not too long), as bytes."""
    lines_read: int = 0
    lines_usable: int = 0
    dropped_empty: int = 0
    dropped_invalid_utf8: int = 0
    dropped_too_long: int = 0

    def counts(self) -> dict[str, int]:
        """The counters, for reports."""
        return {
            "lines_read": self.lines_read,
            "lines_usable": self.lines_usable,
            "dropped_empty": self.dropped_empty,
            "dropped_invalid_utf8": self.dropped_invalid_utf8,
            "dropped_too_long": self.dropped_too_long,
        }


def _lang_rng(seed: int, lang: str, purpose: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random, so they are stable across runs
    # and platforms (unlike hash()); keying by language makes a language's sample independent
    # of which other languages are trained alongside it.
    return random.Random(f"megasemface-spm:{seed}:{lang}:{purpose}")


def reservoir_sample(
    corpus: CorpusSpec, *, capacity: int, seed: int, max_sentence_chars: int
) -> LanguageSample:
    """Streams a language's files once and keeps a uniform random sample of its usable lines.

    Algorithm R: line ``i`` (0-based, usable lines only) replaces a random slot with
    probability ``capacity / (i + 1)``, so memory is bounded by ``capacity`` lines while every
    line is still counted for the temperature weights. Blank lines, invalid UTF-8 and lines
    over ``max_sentence_chars`` characters are dropped and counted.

    Raises:
        CorpusReadError: a file is unreadable or its compressed stream is corrupt.
    """
    _check_int("capacity", capacity, minimum=1)
    _check_int("max_sentence_chars", max_sentence_chars, minimum=1)
    rng = _lang_rng(seed, corpus.lang, "reservoir")
    sample = LanguageSample(lang=corpus.lang, paths=[str(p) for p in corpus.paths], lines=[])
    lines = sample.lines
    usable = 0
    for path in corpus.paths:
        read_in_file = 0
        try:
            for line in iter_lines(path):
                read_in_file += 1
                if not line.strip():
                    sample.dropped_empty += 1
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    sample.dropped_invalid_utf8 += 1
                    continue
                # A line is never longer in characters than in bytes: skip len(text) mostly.
                if len(line) > max_sentence_chars and len(text) > max_sentence_chars:
                    sample.dropped_too_long += 1
                    continue
                usable += 1
                if len(lines) < capacity:
                    lines.append(line)
                else:
                    slot = int(rng.random() * usable)
                    if slot < capacity:
                        lines[slot] = line
        except MemoryError:
            raise
        except Exception as exc:
            # Decompressors raise assorted types (EOFError, zlib.error, LZMAError, ZstdError);
            # report them all as bad input naming the file, not as a traceback.
            raise CorpusReadError(
                f"cannot read corpus file {path} (language {corpus.lang!r}) after "
                f"{read_in_file:,} lines: {type(exc).__name__}: {exc}. The file looks "
                "truncated or corrupt: re-create it, or leave it out"
            ) from exc
        sample.lines_read += read_in_file
    sample.lines_usable = usable
    return sample


def _sample_job(
    corpus: CorpusSpec, capacity: int, seed: int, max_sentence_chars: int
) -> tuple[LanguageSample, float]:
    start = time.perf_counter()
    sample = reservoir_sample(
        corpus, capacity=capacity, seed=seed, max_sentence_chars=max_sentence_chars
    )
    return sample, time.perf_counter() - start


def _sample_all(corpora: Sequence[CorpusSpec], config: SpmTrainConfig) -> list[LanguageSample]:
    args = [
        (spec, config.max_sentences_per_lang, config.seed, config.max_sentence_chars)
        for spec in corpora
    ]
    workers = min(config.num_threads, len(corpora))
    if workers <= 1:
        results: Iterable[tuple[LanguageSample, float]] = (_sample_job(*a) for a in args)
        return [_log_sample(*result) for result in results]
    # Reading and UTF-8 checking is Python-bound (about 1M lines/s), so languages are read in
    # parallel processes. "spawn" because the caller may hold threads (fork is unsafe then);
    # each language's result depends only on its own seed, so parallelism changes nothing.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        results = pool.map(_sample_job, *zip(*args, strict=True))
        # Logged here: spawned workers have no logging configuration.
        return [_log_sample(*result) for result in results]


def _log_sample(sample: LanguageSample, seconds: float) -> LanguageSample:
    logger.info(
        "%s: read %s lines (%s usable), kept %s in %.1f s",
        sample.lang,
        f"{sample.lines_read:,}",
        f"{sample.lines_usable:,}",
        f"{len(sample.lines):,}",
        seconds,
    )
    return sample


def compute_quotas(
    line_counts: Mapping[str, int], budget: int, temperature: float
) -> dict[str, int]:
    """Splits ``budget`` training lines between languages by temperature sampling.

    Shares are ``temperature_probs(line_counts, temperature)``; integer quotas use the
    largest-remainder method so they sum to ``budget`` (ties go to the language given first).
    The one exception: a language with lines that would round to 0 gets 1, so that its
    characters are seen at all.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    probs = temperature_probs(line_counts, temperature)
    raw = {lang: probs[lang] * budget for lang in probs}
    quotas = {lang: math.floor(value) for lang, value in raw.items()}
    missing = budget - sum(quotas.values())
    order = sorted(probs, key=lambda lang: quotas[lang] - raw[lang])  # stable: input order
    for lang in order[:missing]:
        quotas[lang] += 1
    for lang, count in line_counts.items():
        if count > 0 and quotas[lang] == 0 and budget > 0:
            quotas[lang] = 1
    return quotas


def balanced_sentences(
    samples: Iterable[LanguageSample], quotas: Mapping[str, int], seed: int
) -> Iterator[bytes]:
    """Yields each language's quota of lines from its sample, cycling when the quota is larger.

    The sample is shuffled first (seeded): a reservoir's slot order still follows the file
    order for lines that were never replaced, so a prefix of it would not be a uniform
    subsample. Cycling repeats whole passes before a partial one, so up-sampling is as even as
    possible.
    """
    for sample in samples:
        quota = quotas.get(sample.lang, 0)
        if quota <= 0 or not sample.lines:
            continue
        order = list(range(len(sample.lines)))
        _lang_rng(seed, sample.lang, "order").shuffle(order)
        lines = sample.lines
        size = len(order)
        for i in range(quota):
            yield lines[order[i % size]]


def _drain(samples: list[LanguageSample]) -> Iterator[LanguageSample]:
    """Yields the samples while removing them from the list, so each can be freed once used."""
    samples.reverse()
    while samples:
        yield samples.pop()


# --------------------------------------------------------------------------------------------
# Training


def _validate_corpora(corpora: Sequence[CorpusSpec]) -> None:
    if not corpora:
        raise ValueError("no corpora given: need at least one LANG:PATH")
    seen: set[str] = set()
    for spec in corpora:
        if not spec.lang or not spec.lang.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"invalid language code {spec.lang!r}: use letters, digits, '_'")
        if spec.lang in seen:
            raise ValueError(
                f"language {spec.lang!r} is given twice; put all its files in one CorpusSpec"
            )
        seen.add(spec.lang)
        if not spec.paths:
            raise ValueError(f"language {spec.lang!r} has no files")
        for path in spec.paths:
            # Checked up front: finding a typo in the last language after streaming 50M lines
            # of the first ones wastes an hour.
            if not Path(path).is_file():
                raise FileNotFoundError(
                    f"corpus file not found for language {spec.lang!r}: {path} "
                    f"(check the path given as {spec.lang}:PATH)"
                )


def _vocab_text(processor: spm.SentencePieceProcessor) -> str:
    # Same format as SentencePiece's own .vocab file ("piece<TAB>score", score printed with
    # six significant digits); written by us because model_writer skips the .vocab file.
    size = processor.GetPieceSize()
    return "".join(f"{processor.IdToPiece(i)}\t{processor.GetScore(i):g}\n" for i in range(size))


def _train_model(
    sentences: Iterator[bytes], control_symbols: list[str], config: SpmTrainConfig
) -> bytes:
    """Runs the SentencePiece trainer on ``sentences`` and returns the serialized model."""
    buffer = _BytesSink()
    # SentencePiece's random generator is process-global and, unless set, seeded from the
    # system; it is fixed here so that its internal sampling is reproducible.
    spm.set_random_generator_seed(config.seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            # model_writer instead of model_prefix: SentencePiece records model_prefix in the
            # model, which would make the bytes depend on the (temporary) output path.
            model_writer=buffer,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            num_threads=config.num_threads,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            control_symbols=control_symbols,
            # Our sample is already balanced and bounded: SentencePiece must take all of it.
            input_sentence_size=0,
            shuffle_input_sentence=True,
            # train_extremely_large_corpus is left at its default (false): SentencePiece 0.2.x
            # ignores it and warns on every run when it is given explicitly.
            normalization_rule_name="nmt_nfkc",
            max_sentence_length=max(_SPM_DEFAULT_MAX_SENTENCE_BYTES, 4 * config.max_sentence_chars),
            minloglevel=0 if config.verbose else 1,
        )
    except (RuntimeError, ValueError) as exc:
        message = str(exc)
        if "Vocabulary size too high" in message:
            raise ValueError(
                f"vocab_size {config.vocab_size} is too large for this training data; lower "
                f"--vocab-size (or give more data). SentencePiece said: {message}"
            ) from exc
        if "Vocabulary size is smaller than required_chars" in message:
            raise ValueError(
                f"vocab_size {config.vocab_size} is too small for the characters of this data; "
                f"raise --vocab-size or lower --character-coverage. SentencePiece said: {message}"
            ) from exc
        raise RuntimeError(f"SentencePiece training failed: {message}") from exc
    if buffer.data is None:
        raise RuntimeError("SentencePiece training returned no model")
    return buffer.data


class _BytesSink:
    """The ``model_writer`` SentencePiece writes the serialized model to."""

    def __init__(self) -> None:
        self.data: bytes | None = None

    def write(self, data: bytes) -> int:
        self.data = bytes(data)
        return len(data)


def train_spm(
    corpora: list[CorpusSpec], output_prefix: Path, config: SpmTrainConfig
) -> dict[str, Any]:
    """Trains one joint SentencePiece model over several monolingual corpora.

    Writes ``<prefix>.model``, ``<prefix>.vocab`` and ``<prefix>.json`` (each atomically, the
    report last) and returns the report: per-language counts, sampling probabilities and
    quotas, the model's sha256, vocabulary size and ids, and the config.

    With ``num_threads`` > 1 and several languages, the corpora are read in parallel
    processes started with "spawn", so a script calling this must keep its top-level code
    under ``if __name__ == "__main__":`` (as for any multiprocessing code).

    Raises:
        FileNotFoundError: a corpus file does not exist (checked before reading anything).
        CorpusReadError: a corpus file is unreadable or corrupt.
        ValueError: bad corpora (duplicate language, a language with no usable line) or a
            vocabulary size that does not fit the data.
    """
    started = time.perf_counter()
    output_prefix = Path(output_prefix)
    _validate_corpora(corpora)
    languages = [spec.lang for spec in corpora]
    control_symbols = [MASK_PIECE, *(lang_tag(lang) for lang in languages)]
    control_symbols += config.extra_control_symbols
    if len(set(control_symbols)) != len(control_symbols):
        raise ValueError(f"control symbols collide: {control_symbols}")
    reserved = _NUM_SPECIAL + len(control_symbols) + _NUM_BYTE_PIECES
    if config.vocab_size <= reserved:
        raise ValueError(
            f"vocab_size {config.vocab_size} leaves no room for learned pieces: {reserved} ids "
            f"are reserved (4 special, {len(control_symbols)} control, 256 bytes); raise "
            "--vocab-size"
        )
    output_prefix.parent.mkdir(parents=True, exist_ok=True)

    samples = _sample_all(corpora, config)
    empty = [s for s in samples if s.lines_usable == 0]
    if empty:
        details = "; ".join(
            f"{s.lang!r} ({', '.join(s.paths)}: {s.lines_read:,} lines read, "
            f"{s.dropped_empty:,} blank, {s.dropped_invalid_utf8:,} invalid UTF-8, "
            f"{s.dropped_too_long:,} too long)"
            for s in empty
        )
        raise ValueError(f"no usable lines for language {details}; check the input files")
    sampled_at = time.perf_counter()

    line_counts = {s.lang: s.lines_usable for s in samples}
    probs = temperature_probs(line_counts, config.temperature)
    budget = sum(len(s.lines) for s in samples)
    quotas = compute_quotas(line_counts, budget, config.temperature)
    total_usable = sum(line_counts.values())
    per_language: dict[str, dict[str, Any]] = {}
    for s in samples:
        per_language[s.lang] = {
            "paths": s.paths,
            **s.counts(),
            "sampled": len(s.lines),
            "quota": quotas[s.lang],
            "raw_share": s.lines_usable / total_usable,
            "probability": probs[s.lang],
            "share": quotas[s.lang] / sum(quotas.values()),
            "upsampling": quotas[s.lang] / len(s.lines),
        }
    logger.info(
        "training %s %s on %s sentences: %s",
        config.model_type,
        f"{config.vocab_size:,}",
        f"{sum(quotas.values()):,}",
        ", ".join(f"{lang}={q:,}" for lang, q in quotas.items()),
    )

    # SentencePiece copies every line it is given, so each language's sample is released as
    # soon as it has been streamed: the reservoirs and SentencePiece's copy never coexist in
    # full (about 10% of peak memory with the default budget).
    stream = balanced_sentences(_drain(samples), quotas, config.seed)
    model = _train_model(stream, control_symbols, config)
    trained_at = time.perf_counter()

    tokenizer = Tokenizer.from_bytes(model)
    # Cheap guard on the id layout the rest of the project hard-codes.
    if tokenizer.languages != languages or tokenizer.mask_id != MASK_ID:
        raise RuntimeError(
            f"unexpected vocabulary layout: languages {tokenizer.languages} (expected "
            f"{languages}), mask id {tokenizer.mask_id} (expected {MASK_ID})"
        )
    model_path = output_prefix.with_name(output_prefix.name + ".model")
    vocab_path = output_prefix.with_name(output_prefix.name + ".vocab")
    report_path = output_prefix.with_name(output_prefix.name + ".json")
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "languages": languages,
        "per_language": per_language,
        "training_sentences": sum(quotas.values()),
        "vocab_size": tokenizer.vocab_size,
        "model_type": config.model_type,
        "special_ids": {
            "unk": tokenizer.unk_id,
            "bos": tokenizer.bos_id,
            "eos": tokenizer.eos_id,
            "pad": tokenizer.pad_id,
            "mask": tokenizer.mask_id,
        },
        "lang_ids": {lang: tokenizer.lang_id(lang) for lang in languages},
        "model_sha256": tokenizer.sha256,
        "files": {"model": str(model_path), "vocab": str(vocab_path), "report": str(report_path)},
        "sentencepiece_version": spm.__version__,
        "seconds": {
            "sampling": round(sampled_at - started, 3),
            "training": round(trained_at - sampled_at, 3),
        },
        # Lists rather than tuples, so the returned report equals the JSON file's contents.
        "config": {**asdict(config), "extra_control_symbols": list(config.extra_control_symbols)},
    }
    atomic_write_bytes(model_path, model)
    atomic_write_text(vocab_path, _vocab_text(tokenizer.processor))
    # The report goes last: its presence means the model and vocab beside it are complete.
    atomic_write_text(report_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


# --------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A SentencePiece model with the project's conventions (special ids, language tags).

    Build it with :meth:`load` or :meth:`from_bytes`. It pickles as its model bytes, so it can
    be handed to worker processes.
    """

    def __init__(self, model_bytes: bytes, *, path: Path | None = None) -> None:
        """Use :meth:`load` or :meth:`from_bytes`; ``model_bytes`` is a serialized model."""
        if not isinstance(model_bytes, (bytes, bytearray, memoryview)):
            raise TypeError(f"model bytes expected, got {type(model_bytes).__name__}")
        model_bytes = bytes(model_bytes)
        where = f" {path}" if path is not None else ""
        if not model_bytes:
            raise ValueError(f"empty SentencePiece model{where}")
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, ValueError, OSError) as exc:
            raise ValueError(f"not a SentencePiece model{where}: {exc}") from exc
        if processor.GetPieceSize() == 0:
            raise ValueError(f"not a SentencePiece model{where}: no pieces")
        self._sp = processor
        self._model_bytes = model_bytes
        self._path = path
        self._sha256 = hashlib.sha256(model_bytes).hexdigest()
        size = processor.GetPieceSize()
        self._control_ids = frozenset(i for i in range(size) if processor.IsControl(i))
        # Languages are read back from the model, not from a side file, so a model always
        # knows which languages it was trained for.
        self._lang_ids: dict[str, int] = {}
        for i in sorted(self._control_ids):
            lang = lang_from_tag(processor.IdToPiece(i))
            if lang is not None:
                self._lang_ids[lang] = i

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads a ``.model`` file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a SentencePiece model.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        return cls(path.read_bytes(), path=path)

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """Builds a tokenizer from a serialized model (e.g. :attr:`model_bytes`)."""
        return cls(data)

    def __reduce__(self) -> tuple[Any, ...]:
        # SentencePieceProcessor itself is not reliably picklable; the bytes always are.
        return (_unpickle_tokenizer, (self._model_bytes, self._path))

    def __repr__(self) -> str:
        where = str(self._path) if self._path is not None else "<bytes>"
        return (
            f"Tokenizer({where}, vocab_size={self.vocab_size}, languages={self.languages}, "
            f"sha256={self._sha256[:12]})"
        )

    def __len__(self) -> int:
        return self.vocab_size

    # -- identity --------------------------------------------------------------------------

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The underlying SentencePiece processor (for anything not wrapped here)."""
        return self._sp

    @property
    def path(self) -> Path | None:
        """The file the model was loaded from; None when built from bytes."""
        return self._path

    @property
    def model_bytes(self) -> bytes:
        """The serialized model, e.g. to pass to worker processes."""
        return self._model_bytes

    @property
    def sha256(self) -> str:
        """Hex sha256 of the model bytes: identifies the tokenizer data was encoded with."""
        return self._sha256

    # -- vocabulary ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of pieces (ids are ``0 .. vocab_size - 1``)."""
        return int(self._sp.GetPieceSize())

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>`` (0 in models trained here)."""
        return int(self._sp.unk_id())

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (1 in models trained here)."""
        return self._required_id("bos", self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (2 in models trained here)."""
        return self._required_id("eos", self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>`` (3 in models trained here)."""
        return self._required_id("pad", self._sp.pad_id())

    @property
    def mask_id(self) -> int:
        """Id of the ``<mask>`` control symbol (4 in models trained here)."""
        mask = int(self._sp.PieceToId(MASK_PIECE))
        if mask not in self._control_ids:  # PieceToId answers unk_id for unknown pieces
            raise ValueError(f"this model has no {MASK_PIECE} control symbol")
        return mask

    def _required_id(self, name: str, value: int) -> int:
        if value < 0:  # SentencePiece's "disabled"
            raise ValueError(f"this model has no {name} piece")
        return int(value)

    @property
    def languages(self) -> list[str]:
        """Language codes whose tags are control pieces of the model, in id order."""
        return list(self._lang_ids)

    def lang_id(self, lang: str) -> int:
        """Id of a language's tag, e.g. ``lang_id("de")`` is the id of ``__de__``."""
        try:
            return self._lang_ids[lang]
        except KeyError:
            known = ", ".join(self._lang_ids) or "none"
            raise KeyError(
                f"language {lang!r} is not in this tokenizer (languages: {known})"
            ) from None

    @property
    def id_dtype(self) -> np.dtype[Any]:
        """Smallest unsigned dtype holding every id: uint16 up to 65,536 pieces."""
        return np.dtype(np.uint16 if self.vocab_size <= 65536 else np.uint32)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Encodes a batch of texts to ids (no bos/eos, no language tag added).

        ``num_threads`` > 1 lets SentencePiece encode the batch in parallel in C++.
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode takes a list of texts; wrap a single text in a list")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not texts:
            return []
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decodes ids to text, dropping pad, bos/eos, ``<mask>`` and language tags."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ValueError(f"decode takes one sequence of ids, got shape {ids.shape}")
            values = [int(i) for i in ids.tolist()]
        else:
            values = [int(i) for i in ids]
        size = self.vocab_size
        if values and (min(values) < 0 or max(values) >= size):
            bad = next(i for i in values if not 0 <= i < size)
            raise ValueError(f"id {bad} out of range for vocabulary size {size}")
        control = self._control_ids
        return self._sp.decode([i for i in values if i not in control])


def _unpickle_tokenizer(model_bytes: bytes, path: Path | None) -> Tokenizer:
    return Tokenizer(model_bytes, path=path)
