"""``--finetune-mode fusion``: deep fusion's partitioned multi-task fine-tuning.

Supervised fine-tuning of a deep-fusion model (``connect --fusion deep``) with the
translation loss and the three intermediate losses of ``models/fusion.py``, weighted by
``--fusion-weights``. The shards hold the parallel pairs and monolingual text of their
languages in one directory (``tools/build_shards.py --input ... --parallel ...``, as VECO
reads): the run's loader reads the pairs, the unit's own loader the monolingual text, and
every step takes a batch of each, so every step runs all four losses (and the ranks of a
ZeRO-3 run the same modules). The monolingual loader's position is checkpointed per rank
beside the run's, for exact resume. Without the MLM loss (weight 0) parallel shards alone
do.

The target sentence loss's synthetic negatives are made here, on the host, from the step's
generator (so a resumed run makes the same ones): half the batch's targets, picked at
random, each with half its words swapped, replaced or deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megasemface.data.loading.loader import TokenBatch
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.distributed.groups import ParallelGroups
from megasemface.models.fusion import FusionTranslationModel, FusionWeights
from megasemface.nn.config import ModelConfig
from megasemface.objectives.fusion_losses import corrupt_sentences
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch
from megasemface.training import model_flops
from megasemface.training.fusion_options import parse_fusion_weights
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.units.base import rank_loader
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

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        self.weights = FusionWeights(**parse_fusion_weights(config.fusion_weights))
        super().__init__(config, data, groups)
        self.mlm_loader = None
        if self.weights.mlm:
            self.mlm_loader = rank_loader(
                config, data, groups, max_len=self.model_config.max_len - 2,
                languages=self.mlm_languages(),
            )  # fmt: skip
        self._mlm_batches: Iterator[TokenBatch] | None = None

    def mlm_languages(self) -> tuple[str, ...]:
        """The monolingual languages of the shards that the pairs translate between."""
        paired = {lang for pair in self.data.pairs.values() for lang in pair}
        single = set(self.data.manifest.languages) - set(self.data.pairs)
        return tuple(sorted(paired & single))

    def _check_data(self) -> None:
        super()._check_data()
        if self.weights.mlm and not self.mlm_languages():
            languages = sorted({lang for pair in self.data.pairs.values() for lang in pair})
            raise ValueError(
                f"{self.config.data} holds no monolingual text of {', '.join(languages)} for "
                "deep fusion's MLM loss: build the shards with --input LANG:FILE beside "
                "--parallel (tools/build_shards.py), or leave the loss out with "
                "--fusion-weights T,TWP,TSP,0"
            )

    def loader_languages(self) -> tuple[str, ...]:
        return tuple(sorted(self.data.pairs))

    def build_model(self, model_config: ModelConfig) -> FusionTranslationModel:
        if model_config.fusion != "deep":
            raise ValueError(
                "--finetune-mode fusion fine-tunes a deep-fusion model: give --init-from the "
                "model directory of tools/merge_checkpoints.py connect --encoder RUN --fusion deep"
            )
        return FusionTranslationModel(
            model_config,
            self.data.special,
            weights=self.weights,
            label_smoothing=self.config.label_smoothing,
        )

    def mlm_batch(self) -> SequenceBatch | None:
        """The step's batch of monolingual sentences for MLM (None without the loss)."""
        if self.mlm_loader is None:
            return None
        if self._mlm_batches is None:  # after a resume has set the loader's position
            self._mlm_batches = iter(self.mlm_loader)
        batch = next(self._mlm_batches)
        langs = self.data.lang_index(batch.lang, len(batch.lengths))
        return SequenceBatch(batch.tokens, batch.lengths, langs)

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
        mono = self.mlm_batch()
        self.body_flops += self._ptm_flops(tgt, negatives, mono)
        model = self.model
        assert isinstance(model, FusionTranslationModel)  # build_model's
        return engine.run(model.fusion_loss, src, tgt, negatives, mono, generator)

    def _ptm_flops(
        self, tgt: SequenceBatch, negatives: SequenceBatch, mono: SequenceBatch | None
    ) -> float:
        """The PTM's passes the translation body leaves out: TSP's over the targets and
        their negatives, MLM's over the monolingual batch (with its ``</s>``)."""
        config, w = self.model_config, self.weights
        flops = 0.0
        if w.sentence:
            rows = tgt.tokens_BT.shape[0] + negatives.tokens_BT.shape[0]
            width = max(tgt.tokens_BT.shape[1], negatives.tokens_BT.shape[1]) + 1
            flops += model_flops.encoder_stack(config, rows, width, config.encoder_layers)
        if mono is not None:
            rows, width = mono.tokens_BT.shape
            flops += model_flops.encoder_stack(config, rows, width + 1, config.encoder_layers)
        return flops

    def rank_state(self) -> dict[str, Any]:
        return {} if self.mlm_loader is None else {"mlm_loader": self.mlm_loader.state_dict()}

    def load_rank_states(self, states: list[dict[str, Any]]) -> None:
        if self.mlm_loader is None:
            return
        if any("mlm_loader" not in state for state in states):
            raise ValueError(
                "the checkpoint was written without deep fusion's MLM loss (weight 0): resume "
                "with the same --fusion-weights, or start a new --output-dir"
            )
        self.mlm_loader.load_states([state["mlm_loader"] for state in states])
