"""``--finetune-mode fusion``: deep fusion's partitioned multi-task fine-tuning.

Supervised fine-tuning of a deep-fusion model (``connect --fusion deep``) on parallel
shards, with the translation loss and the three intermediate losses of
``models/fusion.py``, weighted by ``--fusion-weights``. The target sentence loss's
synthetic negatives are made here, on the host, from the step's generator (so a resumed run
makes the same ones): half the batch's targets, picked at random, each with half its words
swapped, replaced or deleted.
"""

from __future__ import annotations

import torch

from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.models.fusion import FusionTranslationModel, FusionWeights
from megasemface.nn.config import ModelConfig
from megasemface.objectives.fusion_losses import corrupt_sentences
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch
from megasemface.training.fusion_options import parse_fusion_weights
from megasemface.training.units.translation import SupervisedUnit

__all__ = ["FusionUnit", "synthetic_negatives"]


def synthetic_negatives(
    tgt: SequenceBatch, generator: torch.Generator, *, vocab_size: int, special: tuple[int, ...],
    pad: int,
) -> SequenceBatch:  # fmt: skip
    """Corruptions of half the targets (rounded up), picked at random (TSP's negatives)."""
    rows = tgt.tokens_BT.shape[0]
    picked = torch.randperm(rows, generator=generator)[: (rows + 1) // 2].sort().values
    tokens, lengths = corrupt_sentences(
        tgt.tokens_BT[picked], tgt.lengths_B[picked], generator,
        vocab_size=vocab_size, special_ids=special, pad_id=pad,
    )  # fmt: skip
    return SequenceBatch(tokens, lengths, tgt.langs_B[picked])


class FusionUnit(SupervisedUnit):
    """The four losses of deep fusion on a ``connect --fusion deep`` model."""

    def build_model(self, model_config: ModelConfig) -> FusionTranslationModel:
        if model_config.fusion != "deep":
            raise ValueError(
                "--finetune-mode fusion fine-tunes a deep-fusion model: give --init-from the "
                "model directory of tools/merge_checkpoints.py connect --encoder RUN --fusion deep"
            )
        weights = FusionWeights(**parse_fusion_weights(self.config.fusion_weights))
        return FusionTranslationModel(
            model_config,
            self.data.special,
            weights=weights,
            label_smoothing=self.config.label_smoothing,
        )

    def pair_loss(
        self,
        engine: DeepSpeedEngine,
        src: SequenceBatch,
        tgt: SequenceBatch,
        generator: torch.Generator,
    ) -> StageOutput:
        sp = self.data.special
        negatives = synthetic_negatives(
            tgt, generator, vocab_size=self.model_config.vocab_size, special=sp.all, pad=sp.pad
        )
        return engine.forward("fusion", src, tgt, negatives, generator)
