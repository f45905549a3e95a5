"""Dropout with a cheaper mask on CPU.

``F.dropout`` on CPU draws its mask with ``bernoulli_``: one Mersenne-Twister number per
element. At d 512 with 6+6 layers that costs as much as everything in a training step but
the matrix multiplies (``benchmarks/bench_peer.py``; docs/results.md). Here each
64-bit draw gives four 16-bit numbers, and an element is dropped when its number falls
below ``round(p * 2**16)``: the same generator (``torch.manual_seed``, checkpointed with the
run), a quarter of the draws. The drop rate is ``p`` rounded to a multiple of 2**-16 (0.1
becomes 0.100006), and the kept values are scaled by the inverse of the rate actually used,
so the expectation stays exact. Backward keeps the mask in x's dtype (4 bytes an element in
fp32 where a boolean one takes 1) for a faster step. The draws are one out-of-place
``torch.randint``, which ``torch.compile`` keeps in its graph (an in-place ``random_`` would
break it). On other devices dropout is ``F.dropout``, whose mask comes from a fused
counter-based generator. :func:`scaled_dot_product_attention` is SDPA with its attention
dropout's mask drawn the same way on a CPU. A CPU process puts both in its model's place
(:mod:`megasemface.nn.cpu_speed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Dropout", "dropout", "scaled_dot_product_attention"]

_BITS = 16
"""Random bits per element: an int16 quarter of a 64-bit draw."""


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout: zeroes each element with probability ``p`` and scales the
    others so that the expectation is ``x``."""
    _check_probability(p)
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    threshold = min(round(p * 2**_BITS), 2**_BITS - 1)
    if threshold == 0:
        return x
    # Uniform over all 64 bits, so each int16 quarter is uniform over [-2**15, 2**15).
    draws = torch.randint(-(2**63), 2**63 - 1, ((x.numel() + 3) // 4,), dtype=torch.int64)
    numbers = draws.view(torch.int16)[: x.numel()]
    keep = (numbers >= threshold - 2 ** (_BITS - 1)).view(x.shape)
    # The mask in x's dtype with the scale folded in, which backward reuses: with a boolean
    # mask, a CPU converts it to x's dtype in the forward's product and again in backward's,
    # and scales in a pass of its own: three passes over the activations instead of one.
    return x * keep.to(x.dtype).mul_(2**_BITS / (2**_BITS - threshold))


def scaled_dot_product_attention(
    q_BHTK: torch.Tensor,
    k_BHSK: torch.Tensor,
    v_BHSK: torch.Tensor,
    mask_B1TS: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, except with dropout on a CPU.

    There SDPA falls back to its unfused path and draws the dropout mask of the [B, H, T, S]
    probabilities with ``bernoulli_``, one Mersenne-Twister number per element: a quarter of
    the attention's time at d 512. The same path written out uses :func:`dropout` instead
    (a quarter of the draws). A query with no key to attend to gets the mean of the values
    rather than SDPA's zeros: such rows are padding, which nothing reads.
    """
    if dropout_p == 0.0 or q_BHTK.device.type != "cpu":
        return F.scaled_dot_product_attention(
            q_BHTK, k_BHSK, v_BHSK, attn_mask=mask_B1TS, dropout_p=dropout_p
        )
    scores_BHTS = (q_BHTK * q_BHTK.shape[-1] ** -0.5) @ k_BHSK.transpose(-1, -2)
    if mask_B1TS is not None:
        # The dtype's lowest finite value, not -inf: a row with every key masked stays finite.
        scores_BHTS = scores_BHTS.masked_fill(~mask_B1TS, torch.finfo(scores_BHTS.dtype).min)
    return dropout(scores_BHTS.softmax(dim=-1), dropout_p) @ v_BHSK


def _check_probability(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")


class Dropout(nn.Dropout):
    """``nn.Dropout`` with :func:`dropout` in training mode."""

    def __init__(self, p: float) -> None:
        _check_probability(p)
        super().__init__(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p) if self.training else x

    def extra_repr(self) -> str:
        return f"p={self.p}"
