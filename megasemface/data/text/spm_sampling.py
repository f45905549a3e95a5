"""The balanced training sample for a joint SentencePiece model, in bounded memory.

1. each language's files are streamed once; a seeded reservoir sample keeps at most
   ``capacity`` usable lines while every line is counted (:func:`reservoir_sample`);
2. the training budget (the sum of the reservoir sizes) is split between languages with
   XLM-style temperature sampling over the *full* line counts (:func:`compute_quotas`); a
   language whose quota exceeds its sample is up-sampled by cycling through it
   (:func:`balanced_sentences`), so small languages really get their larger share.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from megasemface.data.text.languages import temperature_probs
from megasemface.data.text.textio import (
    CorpusReadError,
    CorpusSpec,
    iter_lines,
    warn_invalid_utf8,
)

__all__ = [
    "CorpusReadError",
    "LanguageSample",
    "balanced_sentences",
    "check_int",
    "compute_quotas",
    "map_in_processes",
    "reservoir_sample",
    "sample_languages",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raises ValueError unless ``value`` is an int (not a bool) within the bounds."""
    # bool is an int subclass; True as a vocabulary size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


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
    first_invalid_utf8: str | None = None
    """``path:line`` of the first line dropped as invalid UTF-8, if any."""

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
    check_int("capacity", capacity, minimum=1)
    check_int("max_sentence_chars", max_sentence_chars, minimum=1)
    rng = _lang_rng(seed, corpus.lang, "reservoir")
    sample = LanguageSample(lang=corpus.lang, paths=[str(p) for p in corpus.paths], lines=[])
    lines = sample.lines
    usable = 0
    for path in corpus.paths:
        read_in_file = 0
        named = False  # each file's first invalid line is named as soon as it is met
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
                    if not named:
                        named = True
                        warn_invalid_utf8(path, read_in_file)
                        sample.first_invalid_utf8 = sample.first_invalid_utf8 or (
                            f"{path}:{read_in_file}"
                        )
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
        except CorpusReadError as exc:  # the reader names the file, the line and what to do
            raise CorpusReadError(f"language {corpus.lang!r}: {exc}") from None
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


def _call(job: tuple[Callable[..., T], tuple[Any, ...]]) -> T:
    function, args = job
    return function(*args)


def map_in_processes(
    function: Callable[..., T], args: Sequence[tuple[Any, ...]], processes: int
) -> Iterator[T]:
    """``function(*a)`` for each ``a`` of ``args``, in up to ``processes`` spawned processes;
    yields the results in the order of completion.

    The first error of any call is raised as soon as that call fails, and the other calls
    are ended then: a language that cannot be read stops the run at once, not after every
    other language has been read (an hour at tens of millions of lines each). "spawn"
    because the caller may hold threads (fork is unsafe then); ``function`` must be
    importable by name.
    """
    ctx = multiprocessing.get_context("spawn")
    jobs = [(function, a) for a in args]
    # Leaving the block terminates the pool, which ends calls still running after an error.
    with ctx.Pool(min(processes, len(jobs))) as pool:
        yield from pool.imap_unordered(_call, jobs)


def sample_languages(
    corpora: Sequence[CorpusSpec],
    *,
    capacity: int,
    seed: int,
    max_sentence_chars: int,
    processes: int,
) -> list[LanguageSample]:
    """:func:`reservoir_sample` of every language, read in up to ``processes`` processes."""
    args = [(spec, capacity, seed, max_sentence_chars) for spec in corpora]
    if min(processes, len(corpora)) <= 1:
        return [_log_sample(*_sample_job(*a)) for a in args]
    # Reading and UTF-8 checking is Python-bound (about 1M lines/s), so languages are read in
    # parallel processes; each language's result depends only on its own seed, so
    # parallelism changes nothing. Logged here: spawned workers have no logging set-up.
    done = {s.lang: _log_sample(s, t) for s, t in map_in_processes(_sample_job, args, processes)}
    return [done[spec.lang] for spec in corpora]


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
