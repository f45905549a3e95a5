"""Options of the cross-lingual table build, and its error type."""

from __future__ import annotations

import dataclasses

from megasemface.embeddings.inits import INITS
from megasemface.embeddings.mapping import DIRECTIONS, METHODS
from megasemface.embeddings.skipgram import SkipGramConfig

__all__ = ["INITS", "CLEmbeddingConfig", "CLEmbeddingError"]


class CLEmbeddingError(ValueError):
    """The table cannot be built from these inputs; the message says why."""


@dataclasses.dataclass(frozen=True)
class CLEmbeddingConfig:
    """Options of a table build."""

    skipgram: SkipGramConfig = dataclasses.field(default_factory=SkipGramConfig)
    languages: tuple[str, ...] = ()
    """Languages to use (default: all monolingual entries of the manifest, sorted)."""
    pivot: str | None = None
    """Language the others are mapped onto (default: the first language)."""
    init: str = "identical"
    """Initial dictionary (:data:`INITS`): ``identical`` (ids both languages use, the joint
    vocabulary's shared pieces, numerals among them), ``numerals`` (the shared ids holding a
    digit) or ``unsupervised`` (VecMap's similarity-distribution initialisation). A seed
    dictionary given to the build (parallel sentences, a word list) adds its pairs."""
    init_vocab: int = 4000
    """Most frequent ids per language that the unsupervised initialisation compares."""
    seed_min_count: int = 5
    """A shared id seeds the dictionary when it occurs this often in both languages."""
    seed_pair_min_count: int = 2
    """A piece pair of the seed parallel sentences is a seed candidate when it co-occurs in
    this many sentence pairs (one co-occurrence pairs a sentence's every piece by chance)."""
    dict_min_count: int = 10
    """Only ids this frequent in their language take part in dictionary induction: rare
    pieces have noisy vectors and would add spurious pairs."""
    induction_vocab: int | None = 20000
    """At most this many of each language's most frequent ids take part in dictionary
    induction (VecMap's vocabulary cutoff); the map is applied to all rows."""
    max_iterations: int = 20
    direction: str = "mutual"
    retrieval: str = "csls"
    csls_k: int = 10
    stochastic: tuple[float, int] | None = None
    """VecMap's stochastic dictionary induction: (initial keep probability, iterations
    between its doublings); ``None`` keeps every similarity."""
    bli_min_count: int = 10
    """BLI queries and gold targets must occur this often in their language."""
    block_size: int = 2048
    max_tokens_per_lang: int | None = None
    """Read at most about this many tokens per language (whole samples), to bound memory."""
    row_rms: float = 1.0
    """Per-dimension RMS of every output row (row norm ``sqrt(dim) * row_rms``)."""
    centre_languages: bool = True
    """Take each language's mean direction, weighted by how often the language uses each
    id, out of the rows: a row loses the means of the languages that use it, in the shares
    they use it. Without it, the rows of one language share a direction the other's lack
    (docs/corpus.md), the encoder regressing the table carries it into its outputs, and a
    decoder pre-trained on one language's rows reads the other's encoding worse than
    nothing (docs/results.md)."""
    threads: int | None = None
    dictionary_words: int = 1000
    """RAS dictionary (``dictionary_out``): the most frequent single-piece words of each
    language that are translated (mRASP: the 1,000 most frequent words)."""
    dictionary_min_score: float = 0.0
    """RAS dictionary: the confidence threshold, the lowest CSLS score of a pair kept."""

    def __post_init__(self) -> None:
        if min(self.seed_min_count, self.seed_pair_min_count, self.csls_k) < 1:
            raise CLEmbeddingError("seed_min_count, seed_pair_min_count and csls_k must be >= 1")
        if self.max_iterations < 0:
            raise CLEmbeddingError(f"max_iterations must be >= 0, got {self.max_iterations}")
        if self.block_size < 1 or not self.row_rms > 0:
            raise CLEmbeddingError("block_size must be >= 1 and row_rms > 0")
        if self.init not in INITS:
            raise CLEmbeddingError(f"unknown init {self.init!r}; choose one of {tuple(INITS)}")
        if self.direction not in DIRECTIONS or self.retrieval not in METHODS:
            raise CLEmbeddingError(
                f"direction must be one of {DIRECTIONS} and retrieval one of {METHODS}"
            )
        if self.dictionary_words < 1:
            raise CLEmbeddingError(f"dictionary_words must be >= 1, got {self.dictionary_words}")
        if self.init_vocab < 2 or (self.induction_vocab is not None and self.induction_vocab < 2):
            raise CLEmbeddingError("init_vocab and induction_vocab must be >= 2")
        if self.stochastic is not None and not (
            0 < self.stochastic[0] <= 1 and self.stochastic[1] >= 1
        ):
            raise CLEmbeddingError(
                f"stochastic needs (keep probability in (0, 1], interval >= 1), "
                f"got {self.stochastic}"
            )
