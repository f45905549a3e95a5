"""Cross-lingual subword embeddings for CL-SemFace: skip-gram, mapping and the table build."""

from __future__ import annotations

from megasemface.embeddings.build import (
    INITS,
    CLEmbeddingConfig,
    CLEmbeddingError,
    build_cl_embeddings,
)
from megasemface.embeddings.gold import GoldEntry, gold_queries, load_gold_dictionary
from megasemface.embeddings.mapping import (
    bli_precision,
    csls_topk,
    induce_dictionary,
    map_onto,
    normalize,
    procrustes,
    unsupervised_seed,
)
from megasemface.embeddings.skipgram import SkipGramConfig, train_skipgram

__all__ = [
    "INITS",
    "CLEmbeddingConfig",
    "CLEmbeddingError",
    "GoldEntry",
    "SkipGramConfig",
    "bli_precision",
    "build_cl_embeddings",
    "csls_topk",
    "gold_queries",
    "induce_dictionary",
    "load_gold_dictionary",
    "map_onto",
    "normalize",
    "procrustes",
    "train_skipgram",
    "unsupervised_seed",
]
