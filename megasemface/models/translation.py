"""Fine-tuning units: the translation model's losses and its generation entry points.

``TranslationModel`` wraps the connected ``Seq2SeqModel``. Its typed methods are what
fine-tuning runs: the supervised loss (:meth:`~TranslationModel.translation_loss`), the
unsupervised loss (denoising plus back-translation), and the two generation calls of its
``Seq2SeqModel``, ``encode`` and ``decode_step``. Everything
DeepSpeed must see runs through the module's ``forward``, which runs the method it is given
(``DeepSpeedEngine.run``): under ZeRO-3 a module call is what gathers the partitioned
weights, so generation for back-translation and validation goes through the engine too.

Layouts (see ``sequences``): the encoder reads ``x </s>`` with the source language's
embedding; the decoder reads ``<tgt> y`` and predicts ``y </s>``.

Shapes: B batch, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.noising import drop_and_shuffle
from megasemface.objectives.objective import StageOutput, check_languages
from megasemface.objectives.options import PAPER_WORD_DROP
from megasemface.objectives.output_loss import output_cross_entropy
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
)
from megasemface.objectives.teacher_forcing import teacher_forced_hidden

__all__ = ["TranslationModel"]

_T = TypeVar("_T")


class TranslationModel(nn.Module):
    """The sequence-to-sequence model with its fine-tuning losses."""

    def __init__(
        self,
        config: ModelConfig,
        special: SpecialTokens,
        *,
        label_smoothing: float,
        word_drop: float = PAPER_WORD_DROP,
        shuffle_window: int = 3,
    ) -> None:
        super().__init__()
        check_languages(config, special)
        self.config = config
        self.special = special
        self.label_smoothing = label_smoothing
        self.word_drop = word_drop
        self.shuffle_window = shuffle_window
        self.model = Seq2SeqModel(config)

    def forward(self, task: Callable[..., _T], *args: Any) -> _T:
        """``task``, one of this model's methods, run as the module's call (see the module
        docstring): DeepSpeed's engine calls a model only through ``forward``."""
        return task(*args)

    def external_parameters(self) -> list[nn.Parameter]:
        """The tied output layer, read outside the decoder's forward (ZeRO-3 registers it)."""
        return [self.model.decoder.embed.tokens.weight, self.model.decoder.output_bias]

    def translation_loss(
        self, src: SequenceBatch, tgt: SequenceBatch, prefix: str = "mt"
    ) -> StageOutput:
        """Label-smoothed cross-entropy of ``tgt`` given ``src`` (teacher forcing)."""
        hidden, wanted = teacher_forced_hidden(self.model, self.special, src, tgt)
        out = output_cross_entropy(
            hidden, *self.model.decoder.output_layer(), wanted, self.label_smoothing
        )
        return StageOutput(
            out.loss,
            {prefix: out.loss.detach(), f"{prefix}_nll": out.nll},
            {f"{prefix}_accuracy": out.accuracy},
            int(wanted.numel()),
        )

    def denoising_loss(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        """Reconstruct ``x`` from C(x) (word drop and local shuffle), same language."""
        noised, lengths = drop_and_shuffle(
            batch.tokens_BT,
            batch.lengths_B,
            pad_id=self.special.pad,
            generator=generator,
            drop_prob=self.word_drop,
            shuffle_window=self.shuffle_window,
        )
        return self.translation_loss(SequenceBatch(noised, lengths, batch.langs_B), batch, "dae")

    def unsupervised_loss(
        self,
        mono: SequenceBatch,
        generator: torch.Generator,
        back_translated: SequenceBatch | None,
        denoise_weight: float,
    ) -> StageOutput:
        """``denoise_weight`` x denoising of ``mono`` + back-translation (``back_translated``
        -> ``mono``); one call, so DeepSpeed sees a single forward per step."""
        total: StageOutput | None = None
        if denoise_weight > 0:
            dae = self.denoising_loss(mono, generator)
            dae.loss = dae.loss * denoise_weight
            total = dae
        if back_translated is not None:
            bt = self.translation_loss(back_translated, mono, "bt")
            total = bt if total is None else total + bt
        if total is None:
            raise ValueError("nothing to train: denoising weight 0 and no back-translation")
        total.metrics["denoise_weight"] = denoise_weight
        return total
