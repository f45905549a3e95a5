"""Training one joint SentencePiece model over several monolingual corpora.

:func:`train_spm` works in three steps, so that memory stays bounded by
``max_sentences_per_lang`` per language whatever the corpus size (up to tens of millions of
lines per language):

1. each language's files are streamed once into a seeded reservoir sample of at most
   ``max_sentences_per_lang`` usable lines, every line counted;
2. the training budget is split between languages by temperature sampling over the full line
   counts, small languages up-sampled (steps 1 and 2: :mod:`megasemface.data.text.spm_sampling`);
3. SentencePiece is trained on that stream with byte fallback, the fixed special ids of
   :mod:`megasemface.data.text.tokenizer`, ``<mask>`` and one control symbol per language.

Determinism: the same corpora, config and seed give a byte-identical ``.model``. SentencePiece
stores its trainer options, ``num_threads`` included, inside the model, so the bytes (and the
sha256) also depend on ``num_threads``. With BPE the learned pieces do not depend on the thread
count (checked for 1, 2, 4 and 8 threads); with unigram the EM sums are split per thread and
the pieces may differ between thread counts, while still being reproducible for a fixed count.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm

from megasemface.data.text.languages import lang_from_tag, lang_tag, temperature_probs
from megasemface.data.text.spm_sampling import (
    LanguageSample,
    balanced_sentences,
    check_int,
    compute_quotas,
    sample_languages,
)
from megasemface.data.text.textio import CorpusSpec
from megasemface.data.text.tokenizer import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    MASK_PIECE,
    PAD_ID,
    UNK_ID,
    Tokenizer,
)
from megasemface.files import atomic_write_bytes, atomic_write_text

__all__ = ["MODEL_TYPES", "REPORT_FORMAT", "SpmTrainConfig", "train_spm"]

logger = logging.getLogger(__name__)

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
        check_int("vocab_size", self.vocab_size, minimum=1)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if not 0.98 <= self.character_coverage <= 1.0:
            raise ValueError(
                f"character_coverage must be in [0.98, 1.0], got {self.character_coverage}"
            )
        check_int("max_sentences_per_lang", self.max_sentences_per_lang, minimum=1)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        check_int("seed", self.seed, minimum=0, maximum=_MAX_SEED)
        check_int("num_threads", self.num_threads, minimum=1, maximum=_MAX_SPM_THREADS)
        check_int("max_sentence_chars", self.max_sentence_chars, minimum=1)
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


def _drain(samples: list[LanguageSample]) -> Iterator[LanguageSample]:
    """Yields the samples while removing them from the list, so each can be freed once used."""
    samples.reverse()
    while samples:
        yield samples.pop()


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

    samples = sample_languages(
        corpora,
        capacity=config.max_sentences_per_lang,
        seed=config.seed,
        max_sentence_chars=config.max_sentence_chars,
        processes=config.num_threads,
    )
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
            "first_invalid_utf8": s.first_invalid_utf8,
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
