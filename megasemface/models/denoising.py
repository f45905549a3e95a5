"""The mBART-style baseline's pre-training model: the whole encoder-decoder trained to
reconstruct a noised sentence.

Shapes: B batch, T length, N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.noising import (
    infill_spans,
    permute_sentences,
)
from megasemface.objectives.objective import ObjectiveConfig, StageOutput
from megasemface.objectives.options import PRETRAINING_LABEL_SMOOTHING
from megasemface.objectives.output_loss import output_cross_entropy
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
)
from megasemface.objectives.teacher_forcing import teacher_forced_hidden

__all__ = ["DenoisingSeq2Seq"]


class DenoisingSeq2Seq(nn.Module):
    """The mBART-style baseline: the whole encoder-decoder trained to reconstruct a sentence
    from a copy with Poisson(3.5) spans over 35% of tokens infilled (one mask per span) and
    sentences permuted, with the language tag starting the decoder."""

    def __init__(
        self,
        config: ModelConfig,
        special: SpecialTokens,
        objective: ObjectiveConfig | None = None,
        boundary_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.special = special
        self.objective = objective or ObjectiveConfig()
        self.boundary_ids = boundary_ids
        self.model = Seq2SeqModel(config)

    def forward(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        return self.loss(batch, generator)

    def external_parameters(self) -> list[nn.Parameter]:
        """The tied output layer, read outside the decoder's forward (see SemFaceModel)."""
        return [self.model.decoder.embed.tokens.weight, self.model.decoder.output_bias]

    def loss(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        sp, obj = self.special, self.objective
        source, source_lengths = batch.tokens_BT, batch.lengths_B
        if self.boundary_ids:
            source, source_lengths = permute_sentences(
                source,
                source_lengths,
                boundary_ids=self.boundary_ids,
                pad_id=sp.pad,
                generator=generator,
            )
        source, source_lengths = infill_spans(
            source,
            source_lengths,
            mask_id=sp.mask,
            pad_id=sp.pad,
            generator=generator,
            ratio=obj.infill_ratio,
            poisson_lambda=obj.poisson_lambda,
        )
        hidden, wanted = teacher_forced_hidden(
            self.model, sp, SequenceBatch(source, source_lengths, batch.langs_B), batch
        )
        out = output_cross_entropy(
            hidden, *self.model.decoder.output_layer(), wanted, PRETRAINING_LABEL_SMOOTHING
        )
        return StageOutput(
            out.loss,
            {"denoise": out.loss.detach()},
            {"denoise_accuracy": out.accuracy},
            int(wanted.numel()),
        )
