"""VECO's pre-training: in-sequence and cross-sequence MLM on the whole sequence-to-sequence
model (:mod:`megasemface.objectives.veco`), on monolingual and parallel shards.

The shards are one directory that holds both (``tools/build_shards.py --input ...
--parallel ...``); half of the batches are drawn from the pairs and half from the single
languages (VECO alternates them one to one), each kind's own by temperature sampling.
A parallel batch's pairs are (x, y) as they are (source, target); a monolingual batch's
sentences are cut into two adjacent segments, VECO's monolingual (x, y), both in the batch's
language. Every batch runs the same four terms through the same modules, so the ranks of a
ZeRO-3 run stay in lockstep whatever kind of batch each one draws.

The run connects as it is (``tools/merge_checkpoints.py connect --mbart RUN``): encoder,
cross-attention, decoder and its output layer are all pre-trained; the IS-MLM output bias
is dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from megasemface.data.loading.loader import TokenBatch
from megasemface.data.loading.pairs import split_pairs
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.distributed.groups import ParallelGroups
from megasemface.models.veco import VecoSeq2Seq
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch
from megasemface.objectives.veco import split_segments
from megasemface.training import model_flops
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.units.base import TrainUnit, model_config_from, objective_config_from

__all__ = ["PAIR_SHARE", "VecoUnit"]

PAIR_SHARE = 0.5
"""The share of parallel batches: VECO alternates monolingual and parallel ones."""


class VecoUnit(TrainUnit):
    """``--stage veco``: VECO's IS-MLM and CS-MLM pre-training."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        self.model_config = model_config_from(config, data)
        self.model = VecoSeq2Seq(self.model_config, data.special, objective_config_from(config))

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def loader_max_len(self) -> int:
        # Pairs (both sides and the separator) are never cropped by the loader: it needs
        # their longest; every segment is cropped to what the model takes in pairs().
        longest = [layout.max_length for layout in self.data.manifest.pair_layouts.values()]
        return max([super().loader_max_len(), *longest])

    def loader_pair_share(self) -> float | None:
        return PAIR_SHARE

    def pairs(self, batch: TokenBatch) -> tuple[SequenceBatch, SequenceBatch]:
        """(x, y) of every row: a parallel pair's sides, or a sentence's two halves."""
        data, pad = self.data, self.data.special.pad
        if batch.lang in data.pairs:
            first, second = data.pairs[batch.lang]
            separator = data.manifest.pair_layouts[batch.lang].separator_id
            src, src_len, tgt, tgt_len = split_pairs(batch.tokens, batch.lengths, separator, pad)
            x = SequenceBatch(src, src_len, data.lang_index(first, len(src_len)))
            y = SequenceBatch(tgt, tgt_len, data.lang_index(second, len(tgt_len)))
        else:
            x, y = split_segments(batch.tokens, batch.lengths, pad)
            x.langs_B = y.langs_B = data.lang_index(batch.lang, len(batch.lengths))
        # Room for </s> in the encoder and the language tag in the decoder.
        limit = self.model_config.max_len - 1
        return tuple(  # type: ignore[return-value]
            SequenceBatch(s.tokens_BT[:, :limit], s.lengths_B.clamp(max=limit), s.langs_B)
            for s in (x, y)
        )

    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        x, y = self.pairs(batch)
        width = max(x.tokens_BT.shape[1], y.tokens_BT.shape[1])
        self.body_flops = model_flops.veco_body(self.model_config, x.tokens_BT.shape[0], width)
        out = engine.forward(x, y, generator)
        # Which kind of batch this rank drew (the logged value is rank 0's).
        out.metrics["veco_parallel_batch"] = float(batch.lang in self.data.pairs)
        return out
