"""Teacher forcing of a sequence-to-sequence model: the decoder states and targets of a
target sentence given its source, the layout every translation-shaped loss reads.

Shapes: B batch, T length, N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import torch

from megasemface.nn.layers import positions
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)

__all__ = ["teacher_forced_hidden", "teacher_forced_logits"]


def teacher_forced_hidden(
    model: Seq2SeqModel, special: SpecialTokens, src: SequenceBatch, tgt: SequenceBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder states [N, D] and targets [N] of ``tgt`` given ``src``: the encoder reads
    ``src </s>``, the decoder ``<tgt lang> tgt`` and predicts ``tgt </s>`` (N: target tokens
    and </s>)."""
    sp = special
    source, source_lengths = append_token(src.tokens_BT, src.lengths_B, sp.eos, sp.pad)
    tags = torch.tensor(sp.lang_tags, device=tgt.langs_B.device)[tgt.langs_B]
    inputs, lengths = prepend_tokens(tgt.tokens_BT, tgt.lengths_B, tags)
    targets, _ = append_token(tgt.tokens_BT, tgt.lengths_B, sp.eos, sp.pad)
    target_mask = lengths_to_mask(lengths, targets.shape[1])
    selected = positions(target_mask)
    hidden = model(
        source,
        lengths_to_mask(source_lengths, source.shape[1]),
        src.langs_B,
        inputs,
        target_mask,
        tgt.langs_B,
    )
    return hidden.flatten(0, 1)[selected], targets.flatten()[selected]


def teacher_forced_logits(
    model: Seq2SeqModel, special: SpecialTokens, src: SequenceBatch, tgt: SequenceBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, V] and targets [N] of :func:`teacher_forced_hidden`."""
    hidden, targets = teacher_forced_hidden(model, special, src, tgt)
    return model.decoder.logits(hidden), targets
