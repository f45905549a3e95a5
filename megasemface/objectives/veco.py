"""VECO's pairs of sequences and the terms of its loss (the model: ``megasemface.models.veco``).

Shapes: B batch, T length, N predicted tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from megasemface.objectives.sequences import (
    SequenceBatch,
)

__all__ = ["MaskedSide", "VecoTerms", "split_segments", "stack_rows"]


def split_segments(
    tokens_BT: torch.Tensor, lengths_B: torch.Tensor, pad_id: int
) -> tuple[SequenceBatch, SequenceBatch]:
    """VECO's adjacent segments, cut from each sentence (our shards hold sentences, not
    documents): the first ceil(n/2) tokens, then the rest (empty for a one-token sentence).
    The segments' language column is left empty (zeros); the caller sets it."""
    batch, width = tokens_BT.shape
    first_B = (lengths_B + 1) // 2
    second_B = lengths_B - first_B
    positions = torch.arange(width, device=tokens_BT.device)[None]
    x = tokens_BT.masked_fill(positions >= first_B[:, None], pad_id)
    x = x[:, : max(int(first_B.max()) if batch else 0, 1)]
    # Row i of y is tokens_BT[i, first_i : first_i + second_i].
    y_width = max(int(second_B.max()) if batch else 0, 1)
    index = (first_B[:, None] + positions[:, :y_width]).clamp(max=width - 1)
    y = tokens_BT.gather(1, index)
    y = y.masked_fill(positions[:, :y_width] >= second_B[:, None], pad_id)
    langs = torch.zeros(batch, dtype=torch.long, device=tokens_BT.device)
    return SequenceBatch(x, first_B, langs), SequenceBatch(y, second_B, langs.clone())


@dataclasses.dataclass
class MaskedSide:
    """One sequence of the pair, masked: what both of its MLM terms read."""

    inputs_BT: torch.Tensor
    """The masked sequence (no special tokens), pads after each row's length."""
    targets_BT: torch.Tensor
    """The original id where a token is predicted, ``IGNORE_INDEX`` elsewhere."""
    lengths_B: torch.Tensor
    langs_B: torch.Tensor


def stack_rows(first: torch.Tensor, second: torch.Tensor, fill: float | int) -> torch.Tensor:
    """Rows of ``first`` then of ``second`` ([B, T, ...] and [B, U, ...]), padded with
    ``fill`` to the longer length."""
    width = max(first.shape[1], second.shape[1])

    def padded(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == width:
            return t
        pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)
        return torch.cat([t, pad], 1)

    return torch.cat([padded(first), padded(second)], 0)


@dataclasses.dataclass
class VecoTerms:
    """The four terms of a batch of pairs, each the mean cross-entropy of its predicted
    tokens (0 when it has none), and the figures logged with them."""

    is_x: torch.Tensor
    """IS(x): x's masked tokens from x̂ through the encoder."""
    is_y: torch.Tensor
    """IS(y)."""
    cs_x: torch.Tensor
    """CS(y, x): x's masked tokens through the decoder, from ŷ's encoder states and x̂<t."""
    cs_y: torch.Tensor
    """CS(x, y): y's masked tokens through the decoder, from x̂'s encoder states and ŷ<t."""
    is_accuracy: torch.Tensor
    """Detached and on the device, as the other stages' metrics: a logging step reads it."""
    cs_accuracy: torch.Tensor
    num_targets: int
    """Predicted tokens of the four terms."""
