"""Deep fusion's fine-tuning model: partitioned multi-task training (Eq. 15-18).

The translation model is a ``Seq2SeqModel`` with the layer-wise coordinator
(``ModelConfig.fusion == "deep"``, nn/fusion_coordinator.py): the pre-trained encoder (the
PTM), the coordinator and the decoder. Fine-tuning sums four weighted losses, each of which
updates only its partition of the parameters (the paper's Figure 2):

==========================  ===================================================
translation (``mt``)        decoder and coordinator
target words (``twp``)      coordinator and PTM
target sentence (``tsp``)   coordinator and PTM
MLM (``mlm``)               PTM
==========================  ===================================================

One backward over the sum does it, because each loss's graph reaches only its partition: the
translation loss reads the PTM's layer outputs detached, so its gradient stops at the
coordinator; TWP and TSP read the coordinator's aggregation of the live layer outputs (the
aggregation is the coordinator's, the layer attention and mapping serve translation alone);
MLM reads the PTM alone. The heads the intermediate losses add (TWP's bias, TSP's projection
``g``, MLM's bias; the word outputs tied to the PTM's token embeddings) are fine-tuning
parameters: checkpoints keep them for resuming, the model directory (``Seq2SeqModel`` keys)
does not.

MLM reads a batch of monolingual sentences of the pair's languages, beside the parallel
batch the other three read (``training/units/fusion.py`` draws both every step).

Shapes: B batch, K synthetic negatives, S source length, T target length, D model size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megasemface.models.translation import TranslationModel
from megasemface.nn.config import ModelConfig
from megasemface.nn.fusion_coordinator import LayerCoordinator, masked_mean
from megasemface.nn.layers import positions
from megasemface.objectives.fusion_losses import bag_of_words_loss, contrastive_loss
from megasemface.objectives.noising import IGNORE_INDEX, mask_for_mlm
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.output_loss import output_cross_entropy
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)

__all__ = ["FusionHeads", "FusionTranslationModel", "FusionWeights", "join_rows"]


@dataclasses.dataclass(frozen=True)
class FusionWeights:
    """The weights of Eq. 18's four losses (all 1 in the paper); 0 leaves a loss out."""

    translation: float = 1.0
    words: float = 1.0
    sentence: float = 1.0
    mlm: float = 1.0

    def __post_init__(self) -> None:
        values = dataclasses.astuple(self)
        if any(not w >= 0 for w in values) or not any(values):
            raise ValueError(f"the fusion loss weights must be >= 0, not all 0, got {values}")


class FusionHeads(nn.Module):
    """The intermediate losses' own parameters."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.words_bias = nn.Parameter(torch.zeros(config.vocab_size))
        """TWP's output bias (coordinator partition); its weights are the PTM's embeddings."""
        self.sentence = nn.Linear(config.d_model, config.d_model)
        """TSP's projection g (coordinator partition), a linear layer as in SimCLR."""
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        """MLM's output bias (PTM partition), tied weights as in pre-training."""


def join_rows(first: SequenceBatch, second: SequenceBatch, pad: int) -> SequenceBatch:
    """The rows of both batches in one, padded to the wider."""
    width = max(first.tokens_BT.shape[1], second.tokens_BT.shape[1])

    def widen(tokens: torch.Tensor) -> torch.Tensor:
        return F.pad(tokens, (0, width - tokens.shape[1]), value=pad)

    return SequenceBatch(
        torch.cat([widen(first.tokens_BT), widen(second.tokens_BT)]),
        torch.cat([first.lengths_B, second.lengths_B]),
        torch.cat([first.langs_B, second.langs_B]),
    )


class FusionTranslationModel(TranslationModel):
    """The deep-fusion translation model with its partitioned fine-tuning losses; the
    ``fusion`` task is ``fusion_loss``, the others are the translation model's."""

    def __init__(
        self,
        config: ModelConfig,
        special: SpecialTokens,
        *,
        label_smoothing: float,
        weights: FusionWeights | None = None,
        mlm_prob: float = 0.15,
    ) -> None:
        if config.fusion != "deep":
            raise ValueError("fusion fine-tuning needs a deep-fusion model (connect --fusion deep)")
        super().__init__(config, special, label_smoothing=label_smoothing)
        self.weights = weights or FusionWeights()
        self.mlm_prob = mlm_prob
        self.heads = FusionHeads(config)

    @property
    def coordinator(self) -> LayerCoordinator:
        assert self.model.coordinator is not None  # checked in __init__
        return self.model.coordinator

    def external_parameters(self) -> list[nn.Parameter]:
        """Read outside their modules' forward: the tied outputs and the heads' biases."""
        heads = self.heads
        return [
            *super().external_parameters(),
            self.model.encoder.embed.tokens.weight,
            heads.words_bias,
            heads.mlm_bias,
        ]

    def partitions(self) -> dict[str, list[nn.Parameter]]:
        """The parameters each loss may update, by partition: ptm, coordinator, decoder."""
        heads = self.heads
        return {
            "ptm": [*self.model.encoder.parameters(), heads.mlm_bias],
            "coordinator": [
                *self.coordinator.parameters(),
                heads.words_bias,
                *heads.sentence.parameters(),
            ],
            "decoder": list(self.model.decoder.parameters()),
        }

    def ptm_layers(self, side: SequenceBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The PTM's layer outputs for ``side`` (read as ``x </s>``) and their mask."""
        sp = self.special
        tokens, lengths = append_token(side.tokens_BT, side.lengths_B, sp.eos, sp.pad)
        mask = lengths_to_mask(lengths, tokens.shape[1])
        _, layers = self.model.encoder.with_layers(tokens, mask, side.langs_B)
        return layers, mask

    def pooled_top(self, layers: list[torch.Tensor], mask_BS: torch.Tensor) -> torch.Tensor:
        """Eq. 16: the mean-pooled last part of the aggregation, r^A_N [B, D]."""
        return masked_mean(self.coordinator.aggregated(layers)[:, -1], mask_BS)

    def translation_part(
        self, layers: list[torch.Tensor], mask_BS: torch.Tensor, tgt: SequenceBatch
    ) -> StageOutput:
        """L_T through the coordinator from the detached PTM outputs: decoder + coordinator."""
        sp = self.special
        memory = self.coordinator([layer.detach() for layer in layers], mask_BS)
        tags = torch.tensor(sp.lang_tags, device=tgt.langs_B.device)[tgt.langs_B]
        inputs, lengths = prepend_tokens(tgt.tokens_BT, tgt.lengths_B, tags)
        targets, _ = append_token(tgt.tokens_BT, tgt.lengths_B, sp.eos, sp.pad)
        target_mask = lengths_to_mask(lengths, targets.shape[1])
        hidden = self.model.decoder(inputs, target_mask, tgt.langs_B, memory, mask_BS)
        selected = positions(target_mask)
        wanted = targets.flatten()[selected]
        out = output_cross_entropy(
            hidden.flatten(0, 1)[selected],
            *self.model.decoder.output_layer(),
            wanted,
            self.label_smoothing,
        )
        return StageOutput(
            out.loss, {"mt": out.loss.detach(), "mt_nll": out.nll}, {"mt_accuracy": out.accuracy},
            int(wanted.numel()),
        )  # fmt: skip

    def words_loss(self, pooled_BD: torch.Tensor, tgt: SequenceBatch) -> torch.Tensor:
        """TWP (Eq. 15): the target's bag of words from r^A_N, through the PTM's embeddings."""
        weight = self.model.encoder.embed.tokens.weight
        logits = F.linear(pooled_BD, weight.to(pooled_BD.dtype), self.heads.words_bias)
        return bag_of_words_loss(logits, tgt.tokens_BT, tgt.lengths_B, self.special.all)

    def sentence_loss(
        self, pooled_BD: torch.Tensor, tgt: SequenceBatch, negatives: SequenceBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TSP (Eq. 17): g(x) against g(y) of the batch's targets and the synthetic
        negatives, all read by the PTM and aggregated as the source is."""
        candidates = join_rows(tgt, negatives, self.special.pad)
        layers, mask = self.ptm_layers(candidates)
        projected = self.heads.sentence(self.pooled_top(layers, mask))
        rows = tgt.tokens_BT.shape[0]
        return contrastive_loss(self.heads.sentence(pooled_BD), projected[:rows], projected[rows:])

    def mlm_loss(
        self, side: SequenceBatch, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM on monolingual sentences (BERT's masking), through the PTM alone."""
        sp = self.special
        inputs, targets = mask_for_mlm(
            side.tokens_BT,
            side.lengths_B,
            mask_id=sp.mask,
            vocab_size=self.config.vocab_size,
            special_ids=sp.all,
            generator=generator,
            prob=self.mlm_prob,
        )
        tokens, lengths = append_token(inputs, side.lengths_B, sp.eos, sp.pad)
        targets = F.pad(targets, (0, 1), value=IGNORE_INDEX)
        encoder = self.model.encoder
        hidden = encoder(tokens, lengths_to_mask(lengths, tokens.shape[1]), side.langs_B)
        chosen = targets != IGNORE_INDEX
        out = output_cross_entropy(
            hidden.hidden_BTD[chosen], encoder.embed.tokens.weight, self.heads.mlm_bias,
            targets[chosen],
        )  # fmt: skip
        return out.loss, out.accuracy

    def fusion_loss(
        self,
        src: SequenceBatch,
        tgt: SequenceBatch,
        negatives: SequenceBatch,
        mono: SequenceBatch | None,
        generator: torch.Generator,
    ) -> StageOutput:
        """Eq. 18 with the weights: L_T + L_TWP + L_TSP + L_MLM, each on its partition;
        ``negatives`` are TSP's synthetic targets (:func:`~.fusion_losses.corrupt_sentences`)
        in the target language, ``mono`` MLM's monolingual sentences (needed when its weight
        is not 0)."""
        w = self.weights
        layers, mask = self.ptm_layers(src)
        total = self.translation_part(layers, mask, tgt)
        total.loss = total.loss * w.translation
        if w.words or w.sentence:
            pooled = self.pooled_top(layers, mask)
        if w.words:
            words = self.words_loss(pooled, tgt)
            total.loss = total.loss + w.words * words
            total.components["twp"] = words.detach()
        if w.sentence:
            sentence, accuracy = self.sentence_loss(pooled, tgt, negatives)
            total.loss = total.loss + w.sentence * sentence
            total.components["tsp"] = sentence.detach()
            total.metrics["tsp_accuracy"] = accuracy
        if w.mlm:
            if mono is None:
                raise ValueError("the MLM loss has weight > 0 and needs monolingual sentences")
            mlm, accuracy = self.mlm_loss(mono, generator)
            total.loss = total.loss + w.mlm * mlm
            total.components["mlm"] = mlm.detach()
            total.metrics["mlm_accuracy"] = accuracy
        return total
