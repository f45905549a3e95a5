"""VecMap-style orthogonal mapping of one embedding space onto another, and BLI evaluation.

Recipe (Artetxe et al., 2018, the semi-supervised "identical" variant):

1. :func:`normalize`: unit length, mean centring, unit length again, so that dot products
   are cosines and no dimension is dominated by a common offset;
2. a seed dictionary: ids present in both languages (shared subword pieces of the joint
   vocabulary), see :func:`identical_seed`;
3. repeat: an orthogonal map by Procrustes (:func:`procrustes`, the SVD of ``X_d^T Z_d``),
   then a new dictionary by CSLS nearest neighbours of the mapped source among the target
   rows (and back), until the dictionary stops changing or ``max_iterations``.

Retrieval (:func:`csls_topk`) always runs over row blocks, keeping only the top-k per block,
so memory is ``O(block * n_target)``, never ``n_source * n_target``. The fully unsupervised
initialisation of VecMap (similarity-distribution matching) is not implemented: a joint
SentencePiece vocabulary always gives shared pieces to seed from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "MappingResult",
    "bli_precision",
    "csls_topk",
    "map_onto",
    "normalize",
    "procrustes",
]

DIRECTIONS = ("mutual", "forward", "union")


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


def _mean_topk_sim(
    queries: torch.Tensor, keys: torch.Tensor, k: int, block_size: int
) -> torch.Tensor:
    """For each query row, the mean cosine of its k most similar key rows (CSLS's r term)."""
    k = min(k, keys.shape[0])
    out = torch.empty(queries.shape[0], dtype=queries.dtype)
    for start in range(0, queries.shape[0], block_size):
        sims = queries[start : start + block_size] @ keys.T
        out[start : start + block_size] = sims.topk(k, dim=1).values.mean(1)
    return out


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
    if method not in ("csls", "cosine"):
        raise ValueError(f"unknown retrieval method {method!r}; use 'csls' or 'cosine'")
    topk = min(topk, tgt.shape[0])
    if method == "csls":
        context = src if src_context is None else src_context
        r_src = _mean_topk_sim(tgt, context, csls_k, block_size)  # per target row
        r_tgt = _mean_topk_sim(src, tgt, csls_k, block_size)  # per source row
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
    dictionary: torch.Tensor
    """The final [n, 2] (source row, target row) pairs, as indices into the given rows."""


def _induce(
    xw: torch.Tensor, z: torch.Tensor, direction: str, method: str, csls_k: int, block: int
) -> torch.Tensor:
    """A dictionary of (source row, target row) pairs from nearest neighbours."""
    fwd = csls_topk(xw, z, 1, method=method, csls_k=csls_k, block_size=block)[0][:, 0]
    forward = torch.stack([torch.arange(xw.shape[0]), fwd], 1)
    if direction == "forward":
        return forward
    bwd = csls_topk(z, xw, 1, method=method, csls_k=csls_k, block_size=block)[0][:, 0]
    backward = torch.stack([bwd, torch.arange(z.shape[0])], 1)
    if direction == "mutual":
        return forward[bwd[fwd] == torch.arange(xw.shape[0])]
    return torch.unique(torch.cat([forward, backward]), dim=0)  # union


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
) -> MappingResult:
    """Self-learning Procrustes of normalised source rows x onto target rows z.

    ``seed`` is an [n, 2] tensor of (x row, z row) pairs. Each iteration fits the map on the
    current dictionary and induces the next one; it stops once a dictionary repeats.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
    if seed.numel() == 0:
        raise ValueError("the seed dictionary is empty: the languages share no usable id")
    pairs = seed.long()
    sizes: list[int] = []
    converged = False
    iterations = 0
    matrix = procrustes(x[pairs[:, 0]], z[pairs[:, 1]])
    while iterations < max_iterations:
        iterations += 1
        new = _induce(x @ matrix, z, direction, method, csls_k, block_size)
        sizes.append(int(new.shape[0]))
        if new.shape == pairs.shape and torch.equal(
            torch.unique(new, dim=0), torch.unique(pairs, dim=0)
        ):
            converged = True
            break
        pairs = new
        matrix = procrustes(x[pairs[:, 0]], z[pairs[:, 1]])
    return MappingResult(matrix, iterations, converged, int(seed.shape[0]), sizes, pairs)


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
