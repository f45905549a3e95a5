"""VQ-SemFace's codebook started from CL-SemFace's cross-lingual table
(``--vq-codebook-init table``).

The table maps each language's pieces into one space, where a word and its translation lie
close. Codes that start as points of that space are shared by the languages from the first
step: a code is a region of meaning, not of one language's pieces.

Which points: the k-means centroids of the rows of the pieces the shards hold often enough
for the table to have trained them (rarer pieces' rows are random directions), started from
the rows of the K most frequent pieces and moved by a fixed number of Lloyd rounds. The rows
of the K most frequent pieces themselves would give each language its own codes for its own
frequent words ("the" and "der" each a code, side by side), which is what the interface
should not learn; a centroid takes in a piece and its translation alike. With fewer such
pieces than codes the pieces' rows are the first codes as they are (no clustering) and the
other codes keep their random start.

Scale: every code is rescaled to norm sqrt(width), the norm of the layer's N(0, 1) start,
which the distance logits' scale (``nn/code_distance.py``) and the encoder's LayerNorm'd
outputs assume; centroids, means of unit directions, are shorter. Everything is computed in
full and in fp32 on every rank, the same on each, and each model-parallel rank keeps its own
rows (:func:`start_codes`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from megasemface.data.shards.shard_format import Manifest, iter_shard_chunks
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer

__all__ = [
    "COUNT_TOKENS",
    "KMEANS_ROUNDS",
    "TRAINED_MIN_COUNT",
    "piece_counts",
    "start_codes",
    "table_codes",
]

COUNT_TOKENS = 20_000_000
"""The pieces' frequencies are counted over the first this many tokens of each language: all
of the demo's and low-resource corpora, a sample of a paper-scale one's."""
TRAINED_MIN_COUNT = 3
"""A piece has a trained row when some language holds it this often: the table's skip-gram
``min_count`` default (``embeddings/skipgram.py``; the interfaces sit below the table's
builder, so the value is stated here, and a table built with another ``--min-count`` is
still read at this threshold)."""
KMEANS_ROUNDS = 10
"""Lloyd rounds: the assignments of the demo's pieces barely change after a few."""
_BLOCK_ROWS = 4096  # pieces a distance block holds: [block, K] fp32 at a time


def piece_counts(manifest: Manifest, max_tokens: int = COUNT_TOKENS) -> dict[str, np.ndarray]:
    """Each monolingual language's [V] occurrences of every piece in its first
    ``max_tokens`` tokens of the shards."""
    counts = {}
    for lang in sorted(set(manifest.languages) - set(manifest.pair_layouts)):
        counts[lang] = np.zeros(manifest.vocab_size, dtype=np.int64)
        seen = 0
        for chunk in (
            c
            for url in manifest.shard_paths(lang)
            for c in iter_shard_chunks(url, manifest.vocab_size)
        ):
            counts[lang] += np.bincount(chunk.tokens, minlength=manifest.vocab_size)
            seen += len(chunk.tokens)
            if seen >= max_tokens:
                break
    return counts


def _nearest(points_ND: Tensor, centroids_KD: Tensor) -> Tensor:
    """[N] index of each point's nearest centroid (ties: the smallest index)."""
    half_norms = centroids_KD.pow(2).sum(1) / 2
    best = []
    for start in range(0, len(points_ND), _BLOCK_ROWS):
        block = points_ND[start : start + _BLOCK_ROWS]
        best.append((block @ centroids_KD.T - half_norms).argmax(1))
    return torch.cat(best)


def table_codes(table_VD: Tensor, counts: dict[str, np.ndarray], num_codes: int) -> Tensor:
    """[min(K, n), d] codes from the table's rows of the n pieces some language holds at
    least the table's ``min_count`` times (see the module docstring), at norm sqrt(d).

    Raises:
        ValueError: no piece is frequent enough to have a trained row.
    """
    min_count = TRAINED_MIN_COUNT
    total = sum(counts.values())
    trained = np.zeros(len(total), dtype=bool)
    for lang_counts in counts.values():
        trained |= lang_counts >= min_count
    ids = np.flatnonzero(trained)
    if len(ids) == 0:
        raise ValueError(
            f"--vq-codebook-init table: no piece occurs {min_count} times in the shards"
        )
    ids = ids[np.argsort(-total[ids], kind="stable")]  # most frequent first, ties by id
    rows = table_VD[torch.from_numpy(ids)].to(torch.float32)
    codes = rows[:num_codes].clone()
    if len(rows) > num_codes:
        for _ in range(KMEANS_ROUNDS):
            members = _nearest(rows, codes)
            sums = torch.zeros_like(codes).index_add_(0, members, rows)
            sizes = torch.bincount(members, minlength=num_codes)
            filled = sizes > 0  # an empty cluster keeps its centroid
            codes[filled] = sums[filled] / sizes[filled, None].to(sums.dtype)
    norms = codes.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return codes * (math.sqrt(codes.shape[1]) / norms)


@torch.no_grad()
def start_codes(layer: GumbelVectorQuantizer, codes_KD: Tensor) -> None:
    """Sets the first ``len(codes_KD)`` global codes of ``layer``'s flat table to
    ``codes_KD`` (the same full tensor on every rank; each keeps the rows of its shard); the
    other codes keep their start.

    Raises:
        ValueError: a product layout, or codes of another width or more than K of them.
    """
    if layer.layout != "flat":
        raise ValueError(
            "--vq-codebook-init table sets the codes of the flat layout; the product "
            "layout's tables (vq.layout product) start at random: leave the option out"
        )
    if codes_KD.dim() != 2 or codes_KD.shape[1] != layer.d_model:
        raise ValueError(
            f"codes of shape {tuple(codes_KD.shape)}, the codebook's width is {layer.d_model}"
        )
    if len(codes_KD) > layer.num_codes:
        raise ValueError(f"{len(codes_KD)} codes for a codebook of {layer.num_codes}")
    start = layer.code_offset
    stop = min(start + layer.num_local, len(codes_KD))
    if stop > start:
        layer.codebook[: stop - start] = codes_KD[start:stop].to(layer.codebook.dtype)
