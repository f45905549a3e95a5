"""The mapping and merge phases of the table build, on spaces already trained.

Kept apart from the reading and training of :mod:`megasemface.embeddings.build` so that they
can run (and be benchmarked) on any [V, d] spaces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megasemface.embeddings.config import CLEmbeddingConfig, CLEmbeddingError
from megasemface.embeddings.inits import INITS, InitInputs
from megasemface.embeddings.mapping import map_onto

__all__ = ["induction_rows", "language_means", "map_language", "merge_table"]


def induction_rows(
    counts: np.ndarray, trained: np.ndarray, config: CLEmbeddingConfig
) -> np.ndarray:
    """Ids taking part in dictionary induction, most frequent first (ties by id)."""
    ids = np.flatnonzero(trained & (counts >= config.dict_min_count))
    ids = ids[np.argsort(-counts[ids], kind="stable")]
    return ids[: config.induction_vocab] if config.induction_vocab else ids


def _positions(pairs: np.ndarray, x_rows: np.ndarray, z_rows: np.ndarray) -> torch.Tensor:
    """(source id, pivot id) pairs as (position in x_rows, position in z_rows), without
    repeats; pairs of an id outside the induction rows are dropped."""
    position_x = np.full(int(max(x_rows.max(), pairs[:, 0].max(initial=0))) + 1, -1)
    position_z = np.full(int(max(z_rows.max(), pairs[:, 1].max(initial=0))) + 1, -1)
    position_x[x_rows] = np.arange(len(x_rows))
    position_z[z_rows] = np.arange(len(z_rows))
    found = np.stack([position_x[pairs[:, 0]], position_z[pairs[:, 1]]], 1)
    found = found[(found >= 0).all(1)]
    return torch.unique(torch.from_numpy(found).long().reshape(-1, 2), dim=0)


def _seed(
    x: torch.Tensor,
    z: torch.Tensor,
    x_rows: np.ndarray,
    z_rows: np.ndarray,
    x_counts: np.ndarray,
    z_counts: np.ndarray,
    digits: np.ndarray,
    config: CLEmbeddingConfig,
) -> np.ndarray:
    """The initialisation's (source id, pivot id) pairs (:data:`INITS`)."""
    floor = max(config.seed_min_count, config.dict_min_count)
    shared = np.intersect1d(x_rows, z_rows)
    shared = shared[(x_counts[shared] >= floor) & (z_counts[shared] >= floor)]
    inputs = InitInputs(
        x=x,
        z=z,
        x_rows=x_rows,
        z_rows=z_rows,
        shared=shared,
        digits=digits,
        init_vocab=config.init_vocab,
        csls_k=config.csls_k,
        block_size=config.block_size,
    )
    return INITS[config.init](inputs).astype(np.int64).reshape(-1, 2)


def map_language(
    lang: str,
    pivot: str,
    spaces: dict[str, torch.Tensor],
    counts: dict[str, np.ndarray],
    trained: dict[str, np.ndarray],
    config: CLEmbeddingConfig,
    *,
    digits: np.ndarray,
    given: np.ndarray | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The orthogonal map of ``lang`` onto ``pivot`` and its report entry.

    ``digits`` marks the ids whose piece holds a digit (the ``numerals`` initialisation);
    ``given`` holds (``lang`` id, ``pivot`` id) pairs of a seed dictionary from outside
    the spaces, added to the initialisation's.
    """
    x_rows = induction_rows(counts[lang], trained[lang], config)
    z_rows = induction_rows(counts[pivot], trained[pivot], config)
    if min(len(x_rows), len(z_rows)) < 2:
        raise CLEmbeddingError(
            f"{lang} and {pivot} need >= 2 ids seen >= {config.dict_min_count} times each "
            f"(have {len(x_rows)} and {len(z_rows)}); lower dict_min_count or use more data"
        )
    x, z = spaces[lang], spaces[pivot]
    init_pairs = _seed(x, z, x_rows, z_rows, counts[lang], counts[pivot], digits, config)
    init_seed = _positions(init_pairs, x_rows, z_rows)
    given_seed = _positions(given, x_rows, z_rows) if given is not None else init_seed[:0]
    seed = torch.unique(torch.cat([init_seed, given_seed]), dim=0)
    if seed.numel() == 0:
        raise CLEmbeddingError(
            f"the {config.init} initialisation of {lang} onto {pivot} is empty (no id of it "
            f"seen >= {config.seed_min_count} times in both); lower seed_min_count, use more "
            "data, give a seed dictionary or --init unsupervised"
        )
    seed_identical = float((x_rows[seed[:, 0].numpy()] == z_rows[seed[:, 1].numpy()]).mean())
    result = map_onto(
        x[torch.from_numpy(x_rows)],
        z[torch.from_numpy(z_rows)],
        seed,
        max_iterations=config.max_iterations,
        direction=config.direction,
        method=config.retrieval,
        csls_k=config.csls_k,
        block_size=config.block_size,
        stochastic=config.stochastic,
        generator_seed=config.skipgram.seed,
    )
    final = result.dictionary.numpy()
    entry = {
        "onto": pivot,
        "init": config.init,
        "induction_rows": [len(x_rows), len(z_rows)],
        "seed_dictionary": result.seed_size,
        "seed_init": int(init_seed.shape[0]),
        # The given pairs whose two ids take part in induction (frequent enough).
        "seed_given": int(given_seed.shape[0]),
        # The share of seed pairs that are one piece in both languages: 1 for the identical
        # and numeral seeds alone; for the unsupervised one, a sign of whether it found the
        # shared pieces.
        "seed_identical_fraction": round(seed_identical, 4),
        "iterations": result.iterations,
        "converged": result.converged,
        "dictionary_sizes": result.dictionary_sizes,
        "objectives": [round(o, 4) for o in result.objectives],
        "final_identical_fraction": round(
            float((x_rows[final[:, 0]] == z_rows[final[:, 1]]).mean()), 4
        ),
    }
    return result.matrix, entry


def language_means(
    unit_VD: torch.Tensor,
    languages: Sequence[str],
    counts: dict[str, np.ndarray],
    trained_V: torch.Tensor,
    block_size: int,
) -> dict[str, torch.Tensor]:
    """[D] per language: the mean of the ``trained`` rows weighted by the language's count
    of each id, the direction its text adds to every row it reads on average."""
    means = {}
    for lang in languages:
        weights_V = torch.from_numpy(counts[lang]).to(torch.float64) * trained_V
        total = weights_V.sum().clamp_min(1.0)
        mean_D = torch.zeros(unit_VD.shape[1], dtype=torch.float64)
        for start in range(0, unit_VD.shape[0], block_size):
            rows = slice(start, start + block_size)
            mean_D += weights_V[rows] @ unit_VD[rows].to(torch.float64)
        means[lang] = (mean_D / total).to(unit_VD.dtype)
    return means


def _centre_languages(
    unit_VD: torch.Tensor,
    languages: Sequence[str],
    counts: dict[str, np.ndarray],
    trained_V: torch.Tensor,
    block_size: int,
) -> None:
    """Takes out of each trained row the languages' means (:func:`language_means`) in the
    shares its id's uses fall to each language, in place; rows stay to be normalised."""
    means = language_means(unit_VD, languages, counts, trained_V, block_size)
    uses_V = sum(torch.from_numpy(counts[lang]).to(torch.float32) for lang in languages)
    for start in range(0, unit_VD.shape[0], block_size):
        rows = slice(start, start + block_size)
        block_uses = uses_V[rows].clamp_min(1.0)
        shift_BD = sum(
            (torch.from_numpy(counts[lang][rows]).to(torch.float32) / block_uses)[:, None]
            * means[lang]
            for lang in languages
        )
        unit_VD[rows] -= shift_BD * trained_V[rows, None]


def merge_table(
    languages: Sequence[str],
    mapped: dict[str, torch.Tensor],
    counts: dict[str, np.ndarray],
    trained: dict[str, np.ndarray],
    config: CLEmbeddingConfig,
) -> tuple[torch.Tensor, dict[str, int]]:
    """One row per id: the mean of its languages' mapped vectors, or a random direction;
    with ``config.centre_languages``, the languages' means taken out of the first.

    An id trained in no language (never seen, or rarer than ``min_count`` everywhere) gets a
    random direction from a fixed seed: distinct from every other row, meaning nothing.
    Returns the table and the number of ids of each kind.
    """
    vocab_size, dim = mapped[languages[0]].shape
    total = torch.zeros(vocab_size, dim)
    uses = torch.zeros(vocab_size)
    seen = np.zeros(vocab_size, dtype=bool)
    # A block of rows at a time, so that temporaries are block-sized, not [V, d].
    for start in range(0, vocab_size, config.block_size):
        rows = slice(start, start + config.block_size)
        for lang in languages:
            mask = torch.from_numpy(trained[lang][rows])
            total[rows][mask] += torch.nn.functional.normalize(mapped[lang][rows][mask], dim=1)
            uses[rows] += mask
    for lang in languages:
        seen |= counts[lang] > 0
    untrained = uses == 0
    total.div_(total.norm(dim=1, keepdim=True).clamp_min_(1e-12))
    if config.centre_languages:
        _centre_languages(total, languages, counts, ~untrained, config.block_size)
    generator = torch.Generator().manual_seed(config.skipgram.seed + 7919)
    total[untrained] = torch.randn(int(untrained.sum()), dim, generator=generator)
    table = total.div_(total.norm(dim=1, keepdim=True).clamp_min_(1e-12))
    table.mul_(math.sqrt(dim) * config.row_rms)
    if not torch.isfinite(table).all():
        raise CLEmbeddingError("the table holds NaN or infinite values; lower the lr")
    ids = {
        "shared": int((uses > 1).sum()),
        "single_language": int((uses == 1).sum()),
        "rare": int((untrained.numpy() & seen).sum()),
        "unseen": int((~seen).sum()),
    }
    return table, ids
