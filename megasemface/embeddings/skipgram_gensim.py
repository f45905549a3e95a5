"""The ``gensim`` skip-gram backend: gensim's Word2Vec (C, BLAS) on a sentence file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megasemface.embeddings.skipgram import SkipGramConfig

__all__ = ["train_gensim"]


def train_gensim(corpus: Path, config: SkipGramConfig) -> tuple[np.ndarray, np.ndarray]:
    """SGNS on ``corpus`` (a line a sentence, ids as decimal words): (ids, [n, dim] input
    vectors) of the ids at least ``min_count`` times in it."""
    from gensim.models import Word2Vec

    model = Word2Vec(
        corpus_file=str(corpus),
        vector_size=config.dim,
        window=config.window,
        min_count=config.min_count,
        sample=config.subsample,
        sg=1,
        hs=0,
        negative=config.negatives,
        ns_exponent=0.75,
        alpha=config.lr,
        min_alpha=config.lr * 1e-4,
        epochs=config.epochs,
        workers=config.threads,
        seed=config.seed,
    )
    ids = np.array([int(word) for word in model.wv.index_to_key], dtype=np.int64)
    return ids, model.wv.vectors
