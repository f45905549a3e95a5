"""Which codes a VQ layer picks: the noise-free argmax counted over a window of steps.

What the model actually uses is the noise-free argmax (the code inference emits and the
connected model's encoder stands for); one batch's Gumbel-sampled codes overstate it, since
the noise spreads them. :class:`CodeUsage` accumulates the argmax over the steps between two
logs, across data-parallel ranks, and :func:`usage_figures` turns any code histogram into the
figures the trainer, the diagnostics and the tests share.

Whether a window's figures mean a collapse depends on its token count: n tokens drawn
uniformly over K codes use only ``K(1 - (1 - 1/K)^n)`` distinct codes (:func:`uniform_codes`:
84,477 of 102,400 for a window of 178,461 tokens, 15,141 for 16,384), and their histogram's
perplexity is at most ``min(n, K)``. :func:`collapse_warning` compares a window with those
two references, never with K alone, so a large codebook read over a short window is not
called collapsed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from megasemface.distributed.collectives import collective_device
from megasemface.distributed.groups import ParallelGroups, all_reduce_data_parallel

__all__ = [
    "PERPLEXITY_FLOOR",
    "CodeUsage",
    "collapse_warning",
    "count_codes",
    "entropy_shortfall",
    "uniform_codes",
    "usage_figures",
]

PERPLEXITY_FLOOR = 0.1
"""A window whose code histogram's perplexity is under this share of its ceiling
``min(tokens, K)`` has collapsed: its tokens fall on fewer effective codes than a tenth of
what the window could show (n uniform draws reach 0.54 of the ceiling at n = K, nearer 1
further from it)."""


class CodeUsage:
    """Noise-free argmax code usage accumulated over a window of steps, across all ranks.

    Holds one count per code (K int64 on every rank, 800 KB at K = 102,400) and nothing per
    step: :meth:`update` adds a batch's ``greedy_codes`` locally, :meth:`summary` sums the
    counts over the data-parallel group (a collective every dp rank must enter) and starts a
    new window. Model-parallel peers see the same codes (the argmax is global), so they hold
    equal counts and need no collective.
    """

    def __init__(self, num_codes: int, groups: ParallelGroups) -> None:
        self.num_codes = num_codes
        self.groups = groups
        # Allocated on the first batch's device: no copy per step, and a model built on the
        # meta device (then loaded) holds no meta tensor here.
        self.counts: Tensor | None = None

    def update(self, codes: Tensor) -> None:
        """Adds the global code ids ``codes`` [N] of one batch on this rank."""
        codes = codes.detach().reshape(-1)
        if self.counts is None:
            self.counts = torch.zeros(self.num_codes, dtype=torch.int64, device=codes.device)
        self.counts += count_codes(codes, self.num_codes)

    def summary(self) -> dict[str, float]:
        """Over the window: tokens, codes used (count and fraction of K), perplexity of the
        code histogram (``exp`` of its entropy, at most min(K, tokens)) and dead codes (never
        picked in the window); then resets. Empty dict when no token was seen."""
        if self.counts is None:  # no batch here yet (or in this stage); others may have some
            # Zeros where the collective takes its tensors (NCCL: the GPU alone), not kept:
            # the first batch allocates the counts on its own device.
            counts = torch.zeros(self.num_codes, dtype=torch.int64, device=collective_device())
        else:
            counts = self.counts.clone()
            self.counts.zero_()
        counts = all_reduce_data_parallel(counts, self.groups)
        return usage_figures(counts, self.num_codes) if int(counts.sum()) else {}


def count_codes(codes: Tensor, num_codes: int, counted: Tensor | None = None) -> Tensor:
    """[num_codes] int64 histogram of the ids ``codes`` [N] (where ``counted`` [N] bool, if
    given, is true). ``torch.bincount``'s counts without its host synchronisation on a GPU,
    where it first reads the largest id to size its output."""
    ones = torch.ones_like(codes) if counted is None else counted.to(codes.dtype)
    return torch.zeros(num_codes, dtype=torch.int64, device=codes.device).index_add_(0, codes, ones)


def usage_figures(counts: Tensor, num_codes: int) -> dict[str, float]:
    """Figures of a code histogram: ``counts`` of chosen codes (zeros allowed, any subset of
    the codes that holds every used one) out of ``num_codes``: tokens, codes used and their
    fraction, the perplexity ``exp(H)`` of the histogram (1 when one code takes every token,
    the number of used codes when they are used equally) and dead codes (never chosen)."""
    used = counts[counts > 0].to(torch.float64)
    tokens = float(used.sum())
    q = used / max(tokens, 1.0)
    return {
        "tokens": tokens,
        "codes_used": float(used.numel()),
        "codes_used_fraction": used.numel() / num_codes,
        "code_perplexity": float(torch.exp(-(q * q.log()).sum())) if used.numel() else 0.0,
        "dead_codes": float(num_codes - used.numel()),
    }


def uniform_codes(tokens: float, num_codes: int) -> float:
    """The expected number of distinct codes among ``tokens`` draws uniform over
    ``num_codes``: ``K(1 - (1 - 1/K)^n)``, about n while n is small against K and K once n is
    several times K (computed without the cancellation of the formula as written)."""
    if tokens <= 0:
        return 0.0
    if num_codes == 1:
        return 1.0
    return num_codes * -math.expm1(tokens * math.log1p(-1.0 / num_codes))


def collapse_warning(
    figures: Mapping[str, float], *, codes_share: float, part: str, step: int
) -> str | None:
    """The warning for one window's usage ``figures`` (:func:`usage_figures`' keys, the
    window's figures summed over ranks), or None when the codebook has not collapsed.

    A window has collapsed when both hold: its argmax picked fewer codes than
    ``codes_share`` of what a uniform choice would pick for the window's tokens
    (:func:`uniform_codes`), and its histogram's perplexity is under :data:`PERPLEXITY_FLOOR`
    of its ceiling ``min(tokens, K)``. Either alone misreads a healthy codebook: a
    Zipf-shaped choice over every code uses 40% of the uniform codes or more but has a
    perplexity of 2% of the ceiling at K = 102,400, and 12,000 codes used about equally are
    14% of the uniform codes of a 178k-token window but have a perplexity of 11% of its
    ceiling. A collapse fails both by orders of magnitude (15-24 codes of 102,400: 0.03% of
    the uniform codes, a perplexity under 25). A window warned about is always collapsed by
    the perplexity alone.

    ``part`` names the layer in the message (``encoder``), ``step`` the step it ends.
    """
    tokens, used = figures["tokens"], figures["codes_used"]
    codes = int(used + figures["dead_codes"])
    perplexity = figures["code_perplexity"]
    uniform = uniform_codes(tokens, codes)
    ceiling = min(tokens, codes)
    if used >= codes_share * uniform or perplexity >= PERPLEXITY_FLOOR * ceiling:
        return None
    return (
        f"warning: step {step}: the {part} picked {used:,.0f} of {codes:,} VQ codes for "
        f"{tokens:,.0f} tokens since the last log, where a uniform choice would pick "
        f"{uniform:,.0f}; their histogram perplexity is {perplexity:,.1f} of at most "
        f"{ceiling:,.0f}: the codebook is collapsing (under {codes_share:.0%} of the uniform "
        f"codes and a perplexity under {PERPLEXITY_FLOOR:.0%} of its ceiling). Raise "
        "--diversity-weight, check --model vq.diversity_loss or lower --lr; "
        "--codebook-warn-fraction sets the share of uniform codes"
    )


def entropy_shortfall(entropy: Tensor, size: int, tokens: Tensor) -> Tensor:
    """``max(0, ln min(size, tokens) - H)``: how many nats the entropy ``H`` of the batch's
    average code distribution falls short of what ``tokens`` tokens can reach over ``size``
    codes, each token committed to one code (``VQConfig.diversity_loss = "entropy"``).

    The ceiling is the batch's, not the codebook's: a batch of fewer tokens than codes
    reaches ``ln size`` only if every token spreads its distribution over many codes, which
    is what a diversity loss that asks for ``ln size`` then demands. Its gradient with
    respect to ``H`` is -1 wherever it is short, whatever the codebook's state, so that the
    token-entropy term (+1 a nat, times its weight) never outweighs it as a codebook
    collapses, nor the other way round on an unused codebook.
    """
    ceiling = torch.log(tokens.to(torch.float32).clamp(min=1.0, max=float(size)))
    return torch.relu(ceiling - entropy)
