"""Dropout with a cheaper mask on CPU.

``F.dropout`` on CPU draws its mask with ``bernoulli_``: one Mersenne-Twister number per
element. At d 512 with 6+6 layers that is about an eighth of a training step on 2 cores
(``benchmarks/bench_peer.py``), as much as all the layer norms, GELUs and the optimizer
together. Here each 64-bit draw gives four 15-bit numbers, and an element is kept when
its number is at least ``round(p * 2**15)``: the same generator (``torch.manual_seed``,
checkpointed with the run), a quarter of the draws. The drop rate is ``p`` rounded to a
multiple of 2**-15 (0.1 becomes 0.100006), and the kept values are scaled by the inverse
of the rate actually used, so the expectation stays exact. On other devices dropout is
``F.dropout``, whose mask comes from a fused counter-based generator already.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Dropout", "dropout"]

_BITS = 15
"""Random bits per element: the low 15 of each int16 quarter of a non-negative int64 draw
(``random_`` fills an int64 with 63 random bits, so the top quarter has 15)."""


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout: zeroes each element with probability ``p`` and scales the
    others so that the expectation is ``x``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0 or x.numel() == 0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    threshold = round(p * 2**_BITS)
    if threshold == 0:
        return x
    draws = torch.empty(math.ceil(x.numel() / 4), dtype=torch.int64).random_()
    numbers = draws.view(torch.int16)[: x.numel()].bitwise_and_(2**_BITS - 1)
    keep = (numbers >= threshold).view(x.shape)
    return (x * keep).mul_(2**_BITS / (2**_BITS - threshold))


class Dropout(nn.Module):
    """``nn.Dropout`` with :func:`dropout` in training mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p) if self.training else x

    def extra_repr(self) -> str:
        return f"p={self.p}"
