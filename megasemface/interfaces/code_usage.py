"""Which codes a VQ layer picks: the noise-free argmax counted over a window of steps.

What the model actually uses is the noise-free argmax (the code inference emits and the
connected model's encoder stands for); one batch's Gumbel-sampled codes overstate it, since
the noise spreads them. :class:`CodeUsage` accumulates the argmax over the steps between two
logs, across data-parallel ranks, and :func:`usage_figures` turns any code histogram into the
figures the trainer, the diagnostics and the tests share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasemface.distributed.groups import ParallelGroups, all_reduce_data_parallel

__all__ = ["CodeUsage", "count_codes", "usage_figures"]


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
        if self.counts is None:  # no batch on this rank yet; the others may have some
            self.counts = torch.zeros(self.num_codes, dtype=torch.int64)
        counts = all_reduce_data_parallel(self.counts.clone(), self.groups)
        self.counts.zero_()
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
