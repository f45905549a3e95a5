"""Skip-gram with negative sampling (word2vec SGNS) over token-id sentences, batched in torch.

The corpus is given as one flat id array plus sentence offsets, the layout of the token shards,
so that no Python object is made per sentence. It is cut at sentence ends into chunks of about
``chunk_tokens`` tokens, so that the pairs in memory at once are bounded whatever the corpus
size. Each epoch visits the chunks in a random order and, per chunk:

1. frequent tokens are subsampled with word2vec's keep probability
   ``sqrt(t / f) + t / f`` (``f`` the token's relative frequency), and tokens rarer than
   ``min_count`` are dropped, both before windows are formed, as word2vec does;
2. every kept token is paired with each neighbour in the same sentence within a window whose
   size is drawn uniformly in ``[1, window]`` per centre (word2vec's dynamic window, which
   weights near neighbours more);
3. the pairs are shuffled and consumed in batches: ``negatives`` noise ids per pair are drawn
   from the unigram distribution raised to 0.75, and the mean logistic loss of the batch is
   minimised by Adam on the rows the batch touches of two matrices (input and output
   vectors), the step size decaying linearly to ``lr * 1e-4``. Gradients are written out in
   closed form (:func:`sgns_step`) rather than by autograd, whose sparse gradients cost more
   than the arithmetic.

Memory: ``24 V dim`` bytes (two [V, dim] float32 matrices and their two Adam moments), about
``32 (window + 1)`` bytes per token of a chunk for its pairs, and ``4 batch (negatives + 2)
dim`` bytes per batch for the gathered rows and their gradients, times a few temporaries.

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
import time
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["RowAdam", "SkipGramConfig", "SkipGramResult", "sgns_step", "train_skipgram"]

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
    subsample: float = 1e-4
    """word2vec's ``sample`` threshold ``t``; 0 disables subsampling. word2vec's default is
    1e-3; 1e-4 (the value recommended for large corpora) also works better on the small demo
    corpus, whose UI strings repeat a few pieces ("file", ":") very often, and halves the
    pairs."""
    chunk_tokens: int = 1 << 20
    """Tokens per chunk (cut at sentence ends): the unit pairs are made and shuffled in."""
    threads: int = 1
    """torch threads while training. A step's operations are gathers and scatters of a few
    thousand rows, too small to split well: two threads gain little on an idle machine and
    run several times slower while other processes keep the cores busy, as waiting OpenMP
    threads then spin on shared cores (docs/results.md)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"the embedding dimension must be >= 1, got {self.dim}")
        for name in ("window", "epochs", "batch_size", "min_count", "chunk_tokens", "threads"):
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
    seconds: float
    """Wall time of the training loop."""


def _chunk_bounds(offsets: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Sentence indices cutting the corpus into chunks of about ``chunk_tokens`` tokens."""
    targets = np.arange(chunk_tokens, int(offsets[-1]), chunk_tokens)
    cuts = np.searchsorted(offsets, targets)
    return np.unique(np.concatenate([[0], cuts, [len(offsets) - 1]]))


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


class RowAdam:
    """Adam on the rows of one matrix that a step touches (the update rule of SparseAdam).

    Moments of untouched rows are left as they are (lazy Adam); bias correction uses the
    global step count, as ``torch.optim.SparseAdam`` does, so both give the same weights.
    Doing it by hand skips autograd's sparse gradients, whose ``coalesce`` and
    ``sparse_mask`` cost more than the arithmetic at these sizes.
    """

    def __init__(
        self, weight: torch.Tensor, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.weight = weight
        self.exp_avg = torch.zeros_like(weight)
        self.exp_avg_sq = torch.zeros_like(weight)
        self.betas = betas
        self.eps = eps
        self.steps = 0

    def step(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], lr: float) -> None:
        """One update from (rows [n], per-occurrence gradients [n, d]) parts; a row may occur
        many times, its gradients are summed."""
        beta1, beta2 = self.betas
        self.steps += 1
        vocab, dim = self.weight.shape
        # Counting beats torch.unique (a sort) for vocabulary-sized id ranges.
        present = torch.zeros(vocab, dtype=torch.bool)
        for rows, _ in parts:
            present[rows] = True
        unique = present.nonzero().squeeze(1)
        position = torch.empty(vocab, dtype=torch.int64)
        position[unique] = torch.arange(unique.numel())
        grad = torch.zeros(unique.numel(), dim, dtype=self.weight.dtype)
        for rows, grads in parts:
            grad.index_add_(0, position[rows], grads)
        exp_avg = self.exp_avg[unique].mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = self.exp_avg_sq[unique].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self.exp_avg[unique] = exp_avg
        self.exp_avg_sq[unique] = exp_avg_sq
        step_size = lr * math.sqrt(1 - beta2**self.steps) / (1 - beta1**self.steps)
        self.weight.index_add_(
            0, unique, exp_avg.div_(exp_avg_sq.sqrt_().add_(self.eps)), alpha=-step_size
        )


def sgns_step(
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    adam_in: RowAdam,
    adam_out: RowAdam,
    c_ids: torch.Tensor,
    o_ids: torch.Tensor,
    n_ids: torch.Tensor,
    lr: float,
) -> float:
    """One batch of SGNS: the mean loss's gradients in closed form, then Adam; returns the
    summed loss.

    Loss per pair: ``-log s(c.o) - sum_k log s(-c.n_k)`` (s the logistic function). Its
    gradients are ``(s(c.o) - 1) o + sum_k s(c.n_k) n_k`` for c, ``(s(c.o) - 1) c`` for o and
    ``s(c.n_k) c`` for n_k; a test checks them against autograd.
    """
    b, b_dim = c_ids.numel(), w_in.shape[1]
    c_BD = w_in[c_ids]
    o_BD = w_out[o_ids]
    n_BKD = w_out[n_ids]
    pos_B = (c_BD * o_BD).sum(1)
    neg_BK = torch.bmm(n_BKD, c_BD.unsqueeze(2)).squeeze(2)
    loss = -(
        torch.nn.functional.logsigmoid(pos_B).sum() + torch.nn.functional.logsigmoid(-neg_BK).sum()
    )
    g_pos_B = (torch.sigmoid(pos_B) - 1) / b
    g_neg_BK = torch.sigmoid(neg_BK) / b
    grad_c_BD = g_pos_B[:, None] * o_BD + torch.bmm(g_neg_BK.unsqueeze(1), n_BKD).squeeze(1)
    grad_o_BD = g_pos_B[:, None] * c_BD
    grad_n_BKD = g_neg_BK[:, :, None] * c_BD[:, None, :]
    adam_in.step([(c_ids, grad_c_BD)], lr)
    adam_out.step([(o_ids, grad_o_BD), (n_ids.reshape(-1), grad_n_BKD.reshape(-1, b_dim))], lr)
    return float(loss)


def train_skipgram(
    tokens: np.ndarray, offsets: np.ndarray, vocab_size: int, config: SkipGramConfig
) -> SkipGramResult:
    """Trains SGNS on one language's sentences ``tokens[offsets[i]:offsets[i + 1]]``."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _train(tokens, offsets, vocab_size, config)
    finally:
        # The thread count is process-wide: give the caller back what it had.
        torch.set_num_threads(previous_threads)


def _train(
    tokens: np.ndarray, offsets: np.ndarray, vocab_size: int, config: SkipGramConfig
) -> SkipGramResult:
    """The body of :func:`train_skipgram`, run under its thread setting."""
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
    started = time.perf_counter()

    generator = torch.Generator().manual_seed(config.seed)
    dim = config.dim
    # word2vec's init: small uniform input vectors, zero output vectors.
    w_in = (torch.rand(vocab_size, dim, generator=generator) - 0.5) / dim
    w_out = torch.zeros(vocab_size, dim)
    adam_in, adam_out = RowAdam(w_in), RowAdam(w_out)

    counts_t = torch.from_numpy(counts).to(torch.float64)
    keep_t = torch.from_numpy(trained)
    # Unnormalised CDF of the noise distribution, for inverse-CDF sampling (cheaper than
    # multinomial); with side="right" an id of probability 0 can never be drawn.
    noise_cdf = torch.cumsum((counts_t * keep_t).pow(0.75), 0)
    if config.subsample > 0:
        ratio = config.subsample / (counts_t / float(counts_t[keep_t].sum())).clamp_min(1e-30)
        keep_prob = (ratio.sqrt() + ratio).clamp(max=1.0).to(torch.float32)
    else:
        keep_prob = torch.ones(vocab_size)
    keep_prob = keep_prob * keep_t  # rare ids are dropped outright

    bounds = _chunk_bounds(offsets, config.chunk_tokens)
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
        loss_sum, loss_n = 0.0, 0
        for chunk in torch.randperm(len(bounds) - 1, generator=generator).tolist():
            first, last = int(offsets[bounds[chunk]]), int(offsets[bounds[chunk + 1]])
            chunk_tokens = torch.from_numpy(tokens[first:last].astype(np.int64))
            lengths = np.diff(offsets[bounds[chunk] : bounds[chunk + 1] + 1])
            sentence = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
            kept = torch.rand(chunk_tokens.numel(), generator=generator) < keep_prob[chunk_tokens]
            centres, contexts = _pairs(chunk_tokens[kept], sentence[kept], config.window, generator)
            order = torch.randperm(centres.numel(), generator=generator)
            centres, contexts = centres[order], contexts[order]
            for start in range(0, centres.numel(), config.batch_size):
                lr = config.lr * max(1e-4, 1.0 - step / expected_steps)
                step += 1
                c_ids = centres[start : start + config.batch_size]
                o_ids = contexts[start : start + config.batch_size]
                b = c_ids.numel()
                draws = torch.rand(b * config.negatives, generator=generator, dtype=torch.float64)
                n_ids = torch.searchsorted(noise_cdf, draws * noise_cdf[-1], right=True)
                loss_sum += sgns_step(
                    w_in, w_out, adam_in, adam_out, c_ids, o_ids, n_ids.view(b, -1), lr
                )
                loss_n += b
        pairs_seen += loss_n
        losses.append(loss_sum / max(loss_n, 1))
        logger.info("skip-gram epoch %d: %d pairs, loss %.4f", epoch + 1, loss_n, losses[-1])
    return SkipGramResult(w_in, counts, trained, pairs_seen, losses, time.perf_counter() - started)
