"""Skip-gram with negative sampling (word2vec SGNS) over one language's token-id sentences.

The corpus is given as one flat id array plus sentence offsets, the layout of the token
shards. Training is done by a compiled library, chosen by ``SkipGramConfig.backend`` among
:data:`SKIPGRAM_BACKENDS`: gensim's Word2Vec (``gensim``), the one registered. It reads the
sentences from a temporary text file (one sentence a line, ids as decimal words,
:mod:`megasemface.embeddings.sentence_file`), its fast path: C threads that each read their
own part of the file, without the GIL. The library applies word2vec's recipe:
frequent ids subsampled with keep probability ``sqrt(t / f) + t / f``, ids rarer than
``min_count`` dropped before windows are formed, a dynamic window drawn in ``[1, window]``
per centre, ``negatives`` noise ids from the unigram distribution raised to 0.75, and SGD
whose step decays linearly from ``lr`` over the epochs.

The result has one row per id of the joint vocabulary: the library's input vector for the
ids it trained (those with at least ``min_count`` occurrences), word2vec's small uniform
initialisation from ``seed`` for the others, which the build never uses as meaningful.

Why gensim (docs/results.md, "Cross-lingual embeddings"): on the demo corpus it maps to the
same or better lexicon induction than a torch trainer with Adam did, several times faster a
thread; fastText's skip-gram (``maxn=0``) mapped as well but ran slower, has no seed in its
Python API for unsupervised training, and gave different vectors from run to run with one
thread.

Memory: the library's ``8 V dim`` bytes (input and output vectors) and the token arrays the
caller holds; disk: the temporary file, about ``1 + digits`` bytes per token (4-digit ids:
about 5 bytes per token, 50M sentences of 30 tokens: 7.5 GB), in ``tmp_dir``.
"""

from __future__ import annotations

import dataclasses
import importlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from megasemface.embeddings.sentence_file import id_words, write_sentence_file
from megasemface.stages import add_record

__all__ = [
    "SKIPGRAM_BACKENDS",
    "SkipGramBackend",
    "SkipGramConfig",
    "SkipGramResult",
    "register_skipgram_backend",
    "train_skipgram",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SkipGramBackend:
    """A library that trains skip-gram from a sentence file: a ``--skipgram-backend`` value."""

    name: str
    trainer: str
    """``module:function`` taking (sentence file, config) and returning (ids, [n, dim]
    vectors) for the ids it trained."""
    requirement: str
    """The pip requirement it imports, named when it is missing."""


SKIPGRAM_BACKENDS: dict[str, SkipGramBackend] = {}
"""Every skip-gram backend by name (``SkipGramConfig.backend`` names one)."""


def register_skipgram_backend(spec: SkipGramBackend) -> SkipGramBackend:
    """Adds ``spec`` to :data:`SKIPGRAM_BACKENDS`."""
    return add_record(SKIPGRAM_BACKENDS, spec.name, spec, "skip-gram backend")


register_skipgram_backend(
    SkipGramBackend(
        name="gensim",
        trainer="megasemface.embeddings.skipgram_gensim:train_gensim",
        requirement="gensim==4.4.0",
    )
)


@dataclasses.dataclass(frozen=True)
class SkipGramConfig:
    """Options of skip-gram training; the defaults follow word2vec where it has one."""

    dim: int = 300
    window: int = 5
    negatives: int = 5
    epochs: int = 5
    lr: float = 0.025
    """Initial SGD step size, decayed linearly to ``lr * 1e-4`` (word2vec's skip-gram
    default)."""
    min_count: int = 3
    """Ids seen fewer times in a language are neither trained nor used as context."""
    subsample: float = 1e-4
    """word2vec's ``sample`` threshold ``t``; 0 disables subsampling. word2vec's default is
    1e-3; 1e-4 (the value recommended for large corpora) also suits the small demo corpus,
    whose UI strings repeat a few pieces ("file", ":") very often."""
    threads: int = 1
    """Worker threads of the library. With one thread and a fixed seed a run is
    reproducible; with more, threads race on shared rows (Hogwild), as in word2vec."""
    seed: int = 0
    backend: str = "gensim"
    """The library that trains, one of :data:`SKIPGRAM_BACKENDS`."""
    tmp_dir: str | None = None
    """Folder of the temporary sentence file (default: the system's temporary folder)."""

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"the embedding dimension must be >= 1, got {self.dim}")
        for name in ("window", "epochs", "min_count", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.negatives < 1:
            raise ValueError(f"negatives must be >= 1, got {self.negatives}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.subsample < 0:
            raise ValueError(f"subsample must be >= 0, got {self.subsample}")
        if self.backend not in SKIPGRAM_BACKENDS:
            raise ValueError(
                f"skip-gram backend must be one of {tuple(SKIPGRAM_BACKENDS)}, got {self.backend!r}"
            )


@dataclasses.dataclass
class SkipGramResult:
    """Trained input vectors [V, dim] (rows of untrained ids stay at their init) and counts."""

    vectors: torch.Tensor
    counts: np.ndarray
    trained: np.ndarray
    """Boolean [V]: ids with at least ``min_count`` occurrences, the meaningful rows."""
    tokens: int
    """Tokens read, summed over epochs (word2vec's "words"; subsampled ones included)."""
    seconds: float
    """Wall time of the training, the sentence file included."""
    file_seconds: float
    """Of which writing the sentence file."""
    cpu_seconds: float
    """CPU time of the process (every thread) over the same span: with the cores shared,
    ``tokens / cpu_seconds`` is the rate a thread reaches on a core of its own."""


Trainer = Callable[[Path, SkipGramConfig], tuple[np.ndarray, np.ndarray]]


def _trainer(spec: SkipGramBackend) -> Trainer:
    module, _, name = spec.trainer.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ValueError(
            f"skip-gram backend {spec.name!r} needs {spec.requirement} ({exc}); "
            f"pip install {spec.requirement}"
        ) from None


def train_skipgram(
    tokens: np.ndarray, offsets: np.ndarray, vocab_size: int, config: SkipGramConfig
) -> SkipGramResult:
    """Trains SGNS on one language's sentences ``tokens[offsets[i]:offsets[i + 1]]``."""
    tokens = np.asarray(tokens)
    offsets = np.asarray(offsets, dtype=np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens):
        raise ValueError("offsets must start at 0 and end at the number of tokens")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size})")
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.int64)
    trained = counts >= config.min_count
    if not trained.any():
        raise ValueError(f"no id occurs at least min_count={config.min_count} times")
    train = _trainer(SKIPGRAM_BACKENDS[config.backend])
    started, cpu_started = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="skipgram-", dir=config.tmp_dir) as tmp:
        corpus = Path(tmp) / "sentences.txt"
        write_sentence_file(corpus, tokens, offsets, id_words(vocab_size))
        file_seconds = time.perf_counter() - started
        ids, library_vectors = train(corpus, config)
    if not np.array_equal(np.sort(ids), np.flatnonzero(trained)):
        # Both count the same file with the same threshold: a difference is a bug.
        raise RuntimeError(
            f"skip-gram backend {config.backend!r} trained {len(ids)} ids, "
            f"{int(trained.sum())} occur at least min_count={config.min_count} times"
        )
    # word2vec's init for the rows no library trains: small, distinct, seeded.
    generator = torch.Generator().manual_seed(config.seed)
    vectors = (torch.rand(vocab_size, config.dim, generator=generator) - 0.5) / config.dim
    vectors[torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(
        np.ascontiguousarray(library_vectors, dtype=np.float32)
    )
    return SkipGramResult(
        vectors=vectors,
        counts=counts,
        trained=trained,
        tokens=len(tokens) * config.epochs,
        seconds=time.perf_counter() - started,
        file_seconds=file_seconds,
        cpu_seconds=time.process_time() - cpu_started,
    )
