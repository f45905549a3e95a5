"""Cross-lingual subword embeddings for CL-SemFace: skip-gram, mapping and the table build."""

from __future__ import annotations

from megasemface.embeddings.build import (
    CLEmbeddingConfig,
    CLEmbeddingError,
    build_cl_embeddings,
    load_gold_dictionary,
)
from megasemface.embeddings.mapping import bli_precision, csls_topk, map_onto, procrustes
from megasemface.embeddings.skipgram import SkipGramConfig, train_skipgram

__all__ = [
    "CLEmbeddingConfig",
    "CLEmbeddingError",
    "SkipGramConfig",
    "bli_precision",
    "build_cl_embeddings",
    "csls_topk",
    "load_gold_dictionary",
    "map_onto",
    "procrustes",
    "train_skipgram",
]
