"""Skip-gram with negative sampling (word2vec SGNS) over token-id sentences, batched in torch.

The corpus is given as one flat id array plus sentence offsets, the layout of the token shards,
so that no Python object is made per sentence. Each epoch:

1. frequent tokens are subsampled with word2vec's keep probability
   ``sqrt(t / f) + t / f`` (``f`` the token's relative frequency), and tokens rarer than
   ``min_count`` are dropped, both before windows are formed, as word2vec does;
2. every kept token is paired with each neighbour in the same sentence within a window whose
   size is drawn uniformly in ``[1, window]`` per centre (word2vec's dynamic window, which
   weights near neighbours more);
3. the pairs are shuffled and consumed in batches: ``negatives`` noise ids per pair are drawn
   from the unigram distribution raised to 0.75, and the mean logistic loss of the batch is
   minimised with sparse Adam on two sparse embedding matrices (input and output vectors),
   the step size decaying linearly to ``lr * 1e-4``.

Why Adam and not word2vec's SGD: word2vec updates one pair at a time (Hogwild); with batches
of thousands of pairs a frequent piece gets hundreds of gradients per step, so a summed SGD
step diverges and an averaged one barely moves rare pieces. Sparse Adam scales each row's
step by its own gradient history and only touches the rows of the batch. Everything random
comes from one seeded ``torch.Generator``, so a run is reproducible for a given seed and
thread count.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

__all__ = ["SkipGramConfig", "SkipGramResult", "train_skipgram"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SkipGramConfig:
    """Options of skip-gram training; the defaults follow word2vec where it has one."""

    dim: int = 300
    window: int = 5
    negatives: int = 5
    epochs: int = 5
    lr: float = 0.03
    """Initial Adam step size, decayed linearly."""
    batch_size: int = 8192
    min_count: int = 3
    """Ids seen fewer times in a language are neither trained nor used as context."""
    subsample: float = 1e-3
    """word2vec's ``sample`` threshold ``t`` (its default); 0 disables subsampling."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"the embedding dimension must be >= 1, got {self.dim}")
        for name in ("window", "epochs", "batch_size", "min_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.negatives < 0:
            raise ValueError(f"negatives must be >= 0, got {self.negatives}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.subsample < 0:
            raise ValueError(f"subsample must be >= 0, got {self.subsample}")


@dataclasses.dataclass
class SkipGramResult:
    """Trained input vectors [V, dim] (rows of untrained ids stay at their init) and counts."""

    vectors: torch.Tensor
    counts: np.ndarray
    trained: np.ndarray
    """Boolean [V]: ids with at least ``min_count`` occurrences, the meaningful rows."""
    pairs: int
    """(centre, context) pairs trained on, summed over epochs."""
    losses: list[float]
    """Mean loss per epoch."""


def _sentence_ids(offsets: np.ndarray) -> np.ndarray:
    """The sentence index of every token, from sentence offsets."""
    lengths = np.diff(offsets)
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def _pairs(
    tokens: torch.Tensor, sent: torch.Tensor, window: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(centre, context) pairs within each centre's dynamic window, in both directions."""
    n = tokens.numel()
    reach = torch.randint(1, window + 1, (n,), generator=generator)
    centres, contexts = [], []
    for offset in range(1, window + 1):
        if offset >= n:
            break
        same = sent[offset:] == sent[:-offset]
        # Left token as centre looking right, and right token as centre looking left; each
        # direction uses its own centre's window size.
        right = same & (reach[:-offset] >= offset)
        left = same & (reach[offset:] >= offset)
        centres += [tokens[:-offset][right], tokens[offset:][left]]
        contexts += [tokens[offset:][right], tokens[:-offset][left]]
    if not centres:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(centres), torch.cat(contexts)


def train_skipgram(
    tokens: np.ndarray, offsets: np.ndarray, vocab_size: int, config: SkipGramConfig
) -> SkipGramResult:
    """Trains SGNS on one language's sentences ``tokens[offsets[i]:offsets[i + 1]]``."""
    tokens = np.asarray(tokens).astype(np.int64, copy=False)
    offsets = np.asarray(offsets, dtype=np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens):
        raise ValueError("offsets must start at 0 and end at the number of tokens")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size})")
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.int64)
    trained = counts >= config.min_count
    if not trained.any():
        raise ValueError(f"no id occurs at least min_count={config.min_count} times")

    generator = torch.Generator().manual_seed(config.seed)
    dim = config.dim
    # word2vec's init: small uniform input vectors, zero output vectors.
    w_in = torch.nn.Embedding(vocab_size, dim, sparse=True)
    w_out = torch.nn.Embedding(vocab_size, dim, sparse=True)
    with torch.no_grad():
        w_in.weight.copy_((torch.rand(vocab_size, dim, generator=generator) - 0.5) / dim)
        w_out.weight.zero_()
    # Sparse Adam: per-row adaptive steps suit the Zipfian id counts (a frequent piece is in
    # every batch, a rare one in few), where one SGD step size is too big for one and too
    # small for the other once a batch holds thousands of pairs.
    optimizer = torch.optim.SparseAdam(
        list(w_in.parameters()) + list(w_out.parameters()), lr=config.lr
    )

    counts_t = torch.from_numpy(counts).to(torch.float64)
    keep_t = torch.from_numpy(trained)
    noise = (counts_t * keep_t).pow(0.75)
    noise = (noise / noise.sum()).to(torch.float32)
    total = float(counts_t[keep_t].sum())
    if config.subsample > 0:
        freq = counts_t / total
        ratio = config.subsample / freq.clamp_min(1e-30)
        keep_prob = (ratio.sqrt() + ratio).clamp(max=1.0).to(torch.float32)
    else:
        keep_prob = torch.ones(vocab_size)
    keep_prob = keep_prob * keep_t  # rare ids are dropped outright

    all_tokens = torch.from_numpy(tokens)
    all_sent = torch.from_numpy(_sentence_ids(offsets))
    # The decay schedule needs the total step count, which subsampling makes random; the
    # expected pairs per epoch (about window + 1 per kept token) is close enough for a decay.
    expected_kept = float((counts_t * keep_prob.to(torch.float64)).sum())
    expected_steps = max(
        1, math.ceil(config.epochs * expected_kept * (config.window + 1) / config.batch_size)
    )
    step = 0
    pairs_seen = 0
    losses: list[float] = []
    for epoch in range(config.epochs):
        kept = torch.rand(all_tokens.numel(), generator=generator) < keep_prob[all_tokens]
        centres, contexts = _pairs(all_tokens[kept], all_sent[kept], config.window, generator)
        order = torch.randperm(centres.numel(), generator=generator)
        centres, contexts = centres[order], contexts[order]
        loss_sum, loss_n = 0.0, 0
        for start in range(0, centres.numel(), config.batch_size):
            lr = config.lr * max(1e-4, 1.0 - step / expected_steps)
            step += 1
            c_ids = centres[start : start + config.batch_size]
            o_ids = contexts[start : start + config.batch_size]
            b = c_ids.numel()
            c = w_in(c_ids)
            pos = (c * w_out(o_ids)).sum(-1)
            loss = -torch.nn.functional.logsigmoid(pos).sum()
            if config.negatives:
                n_ids = torch.multinomial(
                    noise, b * config.negatives, replacement=True, generator=generator
                ).view(b, config.negatives)
                neg = torch.einsum("bd,bkd->bk", c, w_out(n_ids))
                loss = loss - torch.nn.functional.logsigmoid(-neg).sum()
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            (loss / b).backward()
            optimizer.step()
            loss_sum += float(loss.detach())
            loss_n += b
        pairs_seen += loss_n
        losses.append(loss_sum / max(loss_n, 1))
        logger.info("skip-gram epoch %d: %d pairs, loss %.4f", epoch + 1, loss_n, losses[-1])
    return SkipGramResult(w_in.weight.detach().clone(), counts, trained, pairs_seen, losses)
