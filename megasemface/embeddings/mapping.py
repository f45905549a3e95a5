"""VecMap-style orthogonal mapping of one embedding space onto another, and BLI evaluation.

Recipe (Artetxe et al., 2018):

1. :func:`normalize`: unit length, mean centring, unit length again, so that dot products
   are cosines and no dimension is dominated by a common offset;
2. an initial dictionary: either ids present in both languages (shared subword pieces of the
   joint vocabulary: the semi-supervised "identical" variant), or the fully unsupervised
   initialisation (:func:`unsupervised_seed`), which pairs words whose similarity
   distributions to their own vocabulary look alike;
3. repeat: an orthogonal map by Procrustes (:func:`procrustes`, the SVD of ``X_d^T Z_d``),
   then a new dictionary by CSLS nearest neighbours of the mapped source among the target
   rows (and back, :func:`induce_dictionary`), until the dictionary stops changing or
   ``max_iterations``; optionally with VecMap's stochastic dictionary induction.

Similarities are always computed over row blocks, keeping only per-row and per-column
reductions (top-k, argmax) of each block, so memory is ``O(block * n_target)``, never
``n_source * n_target``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "DIRECTIONS",
    "METHODS",
    "MappingResult",
    "bli_precision",
    "csls_topk",
    "induce_dictionary",
    "map_onto",
    "normalize",
    "procrustes",
    "unsupervised_seed",
]

DIRECTIONS = ("mutual", "forward", "union")
METHODS = ("csls", "cosine")


def normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Unit length, centre, unit length (VecMap's ``unit center unit``), in float32."""
    x = torch.nn.functional.normalize(x.float(), dim=1, eps=eps)
    x = x - x.mean(0, keepdim=True)
    return torch.nn.functional.normalize(x, dim=1, eps=eps)


def procrustes(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The orthogonal W minimising ``||x W - z||_F`` for row-aligned x, z: ``U V^T`` of x^T z."""
    if x.shape != z.shape:
        raise ValueError(f"aligned rows needed, got {tuple(x.shape)} and {tuple(z.shape)}")
    # float64 SVD: the map is applied to the whole vocabulary, so its orthogonality matters
    # more than the few milliseconds a d x d decomposition costs.
    u, _, vt = torch.linalg.svd(x.double().T @ z.double())
    return (u @ vt).to(x.dtype)


def _topk_mean_both(
    x: torch.Tensor, z: torch.Tensor, k: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cosine of each x row to its k nearest z rows, and of each z row to its k nearest
    x rows (CSLS's two hubness terms), from one blocked pass over ``x @ z.T``.

    Rows are taken ``block_size`` at a time; the per-column top-k is merged block by block,
    so memory is ``O(block_size * n_z + k * n_z)``.
    """
    k_x, k_z = min(k, z.shape[0]), min(k, x.shape[0])
    r_x = torch.empty(x.shape[0], dtype=x.dtype)
    col_top = torch.full((k_z, z.shape[0]), -torch.inf, dtype=x.dtype)
    for start in range(0, x.shape[0], block_size):
        sims = x[start : start + block_size] @ z.T
        r_x[start : start + block_size] = sims.topk(k_x, dim=1).values.mean(1)
        block_top = sims.topk(min(k_z, sims.shape[0]), dim=0).values
        col_top = torch.cat([col_top, block_top]).topk(k_z, dim=0).values
    return r_x, col_top.mean(0)


def csls_topk(
    src: torch.Tensor,
    tgt: torch.Tensor,
    topk: int = 1,
    *,
    method: str = "csls",
    csls_k: int = 10,
    block_size: int = 1024,
    src_context: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k target rows for each source row by CSLS (or plain cosine), in row blocks.

    ``CSLS(x, z) = 2 cos(x, z) - r_T(x) - r_S(z)``, where ``r_T(x)`` is the mean cosine of x to
    its ``csls_k`` nearest targets and ``r_S(z)`` that of z to its nearest source rows.
    ``src_context`` (default ``src``) is the source population for ``r_S``: pass all source
    rows when ``src`` holds only the queries. Rows are expected to be unit length.
    Returns (indices, scores), each [n_src, topk].
    """
    if method not in METHODS:
        raise ValueError(f"unknown retrieval method {method!r}; use one of {METHODS}")
    topk = min(topk, tgt.shape[0])
    if method == "csls":
        r_tgt, r_src = _topk_mean_both(src, tgt, csls_k, block_size)
        if src_context is not None:
            r_src = _topk_mean_both(src_context, tgt, csls_k, block_size)[1]
    indices = torch.empty(src.shape[0], topk, dtype=torch.int64)
    scores = torch.empty(src.shape[0], topk, dtype=src.dtype)
    for start in range(0, src.shape[0], block_size):
        sims = src[start : start + block_size] @ tgt.T
        if method == "csls":
            sims = 2 * sims - r_tgt[start : start + block_size, None] - r_src[None, :]
        best = sims.topk(topk, dim=1)
        indices[start : start + block_size] = best.indices
        scores[start : start + block_size] = best.values
    return indices, scores


def induce_dictionary(
    xw: torch.Tensor,
    z: torch.Tensor,
    *,
    direction: str = "mutual",
    method: str = "csls",
    csls_k: int = 10,
    block_size: int = 1024,
    keep_prob: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, float]:
    """A dictionary of (xw row, z row) pairs by nearest neighbours, and its mean similarity.

    ``forward`` pairs every xw row with its best z row, ``union`` adds every z row with its
    best xw row, ``mutual`` keeps the forward pairs that are also backward pairs. CSLS is
    symmetric, so both directions come from the same blocked pass over ``xw @ z.T`` (plus one
    pass for the hubness terms): two matrix products per call, whatever the direction, and
    ``O(block_size * n_z)`` memory. ``keep_prob < 1`` is VecMap's stochastic dictionary
    induction: each similarity is dropped with probability ``1 - keep_prob`` before the
    argmax, so that self-learning can leave a poor initial dictionary. The returned mean is
    of the forward and backward best scores before dropout (VecMap's objective).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
    if method not in METHODS:
        raise ValueError(f"unknown retrieval method {method!r}; use one of {METHODS}")
    if method == "csls":
        r_x, r_z = _topk_mean_both(xw, z, csls_k, block_size)
    n_x, n_z = xw.shape[0], z.shape[0]
    fwd = torch.empty(n_x, dtype=torch.int64)
    fwd_best = torch.empty(n_x, dtype=xw.dtype)
    bwd = torch.zeros(n_z, dtype=torch.int64)
    bwd_score = torch.full((n_z,), -torch.inf, dtype=xw.dtype)  # after dropout
    bwd_best = torch.full((n_z,), -torch.inf, dtype=xw.dtype)
    for start in range(0, n_x, block_size):
        sims = xw[start : start + block_size] @ z.T
        if method == "csls":
            # In place: at 2,048 x 20,000 each temporary would be another 160 MB.
            sims.mul_(2).sub_(r_x[start : start + block_size, None]).sub_(r_z[None, :])
        row, col = sims.max(1), sims.max(0)
        fwd_best[start : start + block_size] = row.values
        bwd_best = torch.maximum(bwd_best, col.values)
        row_idx = row.indices
        if keep_prob < 1.0:
            # Independent masks per direction, as in VecMap.
            drop = torch.rand(sims.shape, generator=generator) >= keep_prob
            row_idx = sims.masked_fill(drop, -torch.inf).argmax(1)
            drop = torch.rand(sims.shape, generator=generator) >= keep_prob
            col = sims.masked_fill_(drop, -torch.inf).max(0)
        fwd[start : start + block_size] = row_idx
        better = col.values > bwd_score
        bwd_score = torch.where(better, col.values, bwd_score)
        bwd = torch.where(better, col.indices + start, bwd)
    objective = float((fwd_best.mean() + bwd_best.mean()) / 2)
    forward = torch.stack([torch.arange(n_x), fwd], 1)
    if direction == "forward":
        return forward, objective
    if direction == "mutual":
        return forward[bwd[fwd] == torch.arange(n_x)], objective
    backward = torch.stack([bwd, torch.arange(n_z)], 1)
    return torch.unique(torch.cat([forward, backward]), dim=0), objective


def _sorted_sqrt_similarity(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows of ``sqrt(x x^T)`` each sorted, then normalised: a rotation- and order-free
    signature of each row's similarity distribution.

    ``sqrt(x x^T) = U S U^T`` from the thin SVD ``x = U S V^T``; it is filled a row block at
    a time (each block sorted at once), so the only n x n matrix is the result.
    """
    u, s, _ = torch.linalg.svd(x.double(), full_matrices=False)
    us, u = (u * s).float(), u.float()
    out = torch.empty(x.shape[0], x.shape[0])
    for start in range(0, x.shape[0], block_size):
        out[start : start + block_size] = (us[start : start + block_size] @ u.T).sort(1).values
    return normalize(out)


def unsupervised_seed(
    x: torch.Tensor,
    z: torch.Tensor,
    *,
    direction: str = "union",
    csls_k: int = 10,
    block_size: int = 1024,
) -> torch.Tensor:
    """VecMap's fully unsupervised initial dictionary (Artetxe et al., 2018, section 3.2).

    ``x`` and ``z`` are the normalised vectors of each language's most frequent ids (VecMap
    takes 4,000). Equivalent words have similar similarity distributions to the rest of
    their own vocabulary whatever the rotation between the spaces, so each row's sorted
    ``sqrt(x x^T)`` row is compared across languages, and pairs are induced by CSLS on those
    signatures. Memory: two n x n float32 matrices (4,000 rows: 128 MB) plus a row block.
    Returns [m, 2] (x row, z row) pairs.
    """
    n = min(x.shape[0], z.shape[0])
    if n < 2:
        raise ValueError("the unsupervised initialisation needs at least 2 rows per language")
    x_sig = _sorted_sqrt_similarity(x[:n], block_size)
    z_sig = _sorted_sqrt_similarity(z[:n], block_size)
    pairs, _ = induce_dictionary(
        x_sig, z_sig, direction=direction, csls_k=csls_k, block_size=block_size
    )
    return pairs


@dataclasses.dataclass
class MappingResult:
    """An orthogonal map of the source space onto the target space."""

    matrix: torch.Tensor
    """[d, d] orthogonal: ``source @ matrix`` lives in the target space."""
    iterations: int
    converged: bool
    seed_size: int
    dictionary_sizes: list[int]
    """Dictionary size after each refinement."""
    objectives: list[float]
    """Mean CSLS (or cosine) of the best matches after each refinement."""
    dictionary: torch.Tensor
    """The final [n, 2] (source row, target row) pairs, as indices into the given rows."""


def map_onto(
    x: torch.Tensor,
    z: torch.Tensor,
    seed: torch.Tensor,
    *,
    max_iterations: int = 20,
    direction: str = "mutual",
    method: str = "csls",
    csls_k: int = 10,
    block_size: int = 1024,
    stochastic: tuple[float, int] | None = None,
    generator_seed: int = 0,
) -> MappingResult:
    """Self-learning Procrustes of normalised source rows x onto target rows z.

    ``seed`` is an [n, 2] tensor of (x row, z row) pairs. Each iteration fits the map on the
    current dictionary and induces the next one; it stops once a dictionary repeats.
    ``stochastic=(p0, interval)`` turns on VecMap's stochastic dictionary induction: the
    keep probability starts at p0 and doubles every ``interval`` iterations; the dictionary
    can only converge once it reaches 1.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
    if x.shape[1] != z.shape[1]:
        raise ValueError(
            f"embedding dimensions differ: source {x.shape[1]}, target {z.shape[1]}; "
            "train every language with the same dimension"
        )
    if seed.numel() == 0:
        raise ValueError("the seed dictionary is empty: the languages share no usable id")
    if stochastic is not None and not (0 < stochastic[0] <= 1 and stochastic[1] >= 1):
        raise ValueError(f"stochastic needs (keep_prob in (0, 1], interval >= 1), {stochastic}")
    generator = torch.Generator().manual_seed(generator_seed)
    seed = torch.unique(seed.long(), dim=0)
    pairs = seed
    sizes: list[int] = []
    objectives: list[float] = []
    converged = False
    iterations = 0
    matrix = procrustes(x[pairs[:, 0]], z[pairs[:, 1]])
    while iterations < max_iterations:
        keep_prob = 1.0
        if stochastic is not None:
            keep_prob = min(1.0, stochastic[0] * 2.0 ** (iterations // stochastic[1]))
        iterations += 1
        new, objective = induce_dictionary(
            x @ matrix,
            z,
            direction=direction,
            method=method,
            csls_k=csls_k,
            block_size=block_size,
            keep_prob=keep_prob,
            generator=generator,
        )
        new = torch.unique(new, dim=0)  # sorted rows, so equal dictionaries compare equal
        sizes.append(int(new.shape[0]))
        objectives.append(objective)
        if keep_prob == 1.0 and torch.equal(new, pairs):
            converged = True
            break
        pairs = new
        matrix = procrustes(x[pairs[:, 0]], z[pairs[:, 1]])
    return MappingResult(
        matrix, iterations, converged, int(seed.shape[0]), sizes, objectives, pairs
    )


def bli_precision(
    src_vecs: torch.Tensor,
    tgt_vecs: torch.Tensor,
    pairs: Iterable[tuple[int, int]],
    k: Sequence[int] = (1, 5),
    *,
    method: str = "csls",
    src_candidates: torch.Tensor | None = None,
    tgt_candidates: torch.Tensor | None = None,
    csls_k: int = 10,
    block_size: int = 1024,
) -> dict[str, float | int]:
    """Bilingual lexicon induction precision@k of gold (source id, target id) pairs.

    A source id counts as a hit at k when any of its gold targets is among its k best
    retrieved target ids. Retrieval searches ``tgt_candidates`` (default: all target rows);
    ``src_candidates`` is the source population for CSLS's hubness term. Rows are normalised
    here, so raw or mapped vectors can be passed. Returns ``p@k`` for each k and ``queries``.
    """
    gold: dict[int, set[int]] = {}
    for s, t in pairs:
        gold.setdefault(int(s), set()).add(int(t))
    if not gold:
        raise ValueError("no gold pairs to evaluate")
    n_src, n_tgt = src_vecs.shape[0], tgt_vecs.shape[0]
    src_rows = torch.arange(n_src) if src_candidates is None else src_candidates.long()
    tgt_rows = torch.arange(n_tgt) if tgt_candidates is None else tgt_candidates.long()
    src_n = torch.nn.functional.normalize(src_vecs.float(), dim=1)
    tgt_n = torch.nn.functional.normalize(tgt_vecs.float(), dim=1)
    queries = sorted(gold)
    found, _ = csls_topk(
        src_n[queries],
        tgt_n[tgt_rows],
        max(k),
        method=method,
        csls_k=csls_k,
        block_size=block_size,
        src_context=src_n[src_rows],
    )
    retrieved = tgt_rows[found]  # back to target ids
    out: dict[str, float | int] = {"queries": len(queries)}
    for kk in k:
        hits = sum(bool(gold[q] & set(retrieved[i, :kk].tolist())) for i, q in enumerate(queries))
        out[f"p@{kk}"] = hits / len(queries)
    return out
