"""Pre-training units: SemFace's encoder, decoder and joint stages (XLM is the encoder stage
without an interface) and mBART's denoising baseline."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megasemface.checkpoints import load_codebook
from megasemface.data.loading.loader import TokenBatch
from megasemface.distributed.collectives import rank
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces import registry
from megasemface.interfaces.factory import build_interface
from megasemface.interfaces.registry import TABLE_CODES, shard_piece_counts
from megasemface.models.denoising import DenoisingSeq2Seq
from megasemface.models.semface import SemFaceModel
from megasemface.objectives.noising import sentence_boundary_ids
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch
from megasemface.stages import stage
from megasemface.tracking.tracker import Tracker
from megasemface.training import model_flops
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.units.base import (
    TrainUnit,
    model_config_from,
    objective_config_from,
    ras_from,
    substitute,
)
from megasemface.training.units.pretraining_validation import PretrainingValidation

__all__ = ["DenoisingUnit", "SemFaceUnit"]


class _MonolingualUnit(TrainUnit):
    """A unit that reads monolingual shards, one language per batch."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        if data.pairs:
            raise ValueError(
                f"{config.data} holds parallel data ({sorted(data.pairs)}); pre-training "
                "stages read monolingual shards (parallel shards are for --stage finetune)"
            )
        self.model_config = model_config_from(config, data)

    def sequence_batch(self, batch: TokenBatch) -> SequenceBatch:
        return SequenceBatch(
            batch.tokens, batch.lengths, self.data.lang_index(batch.lang, len(batch.lengths))
        )


class SemFaceUnit(_MonolingualUnit):
    """``--stage encoder|decoder|joint``: the SemFace model with its interface; a stage
    trains its own part, everything else is frozen and kept out of the optimizer."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        table_codes = config.vq_codebook_init == TABLE_CODES  # counts the shards' pieces
        interface = build_interface(
            config.interface,
            self.model_config,
            groups=groups,
            seed=config.seed,
            cl_table=config.cl_table,
            cl_trainable=config.cl_trainable,
            cl_unit_logits=config.cl_unit_logits,
            cl_unit_mse=config.cl_unit_mse,
            cl_table_input=config.cl_table_input,
            vq_codebook_init=config.vq_codebook_init,
            piece_counts=shard_piece_counts(data.manifest) if table_codes else None,
        )
        model = SemFaceModel(
            self.model_config, interface, data.special, objective_config_from(config)
        )
        run_stage = stage(config.stage)
        codebook = registry.interface(config.interface).codebook
        if codebook and run_stage.decoder and not run_stage.encoder:
            self._load_codebook(model)  # the decoder stage's codes are the encoder stage's
        model.stage = config.stage
        keep: list[nn.Parameter] = []
        if run_stage.encoder:
            keep += model.encoder_stage_parameters()
        if run_stage.decoder:
            keep += model.decoder_stage_parameters()
        kept = {id(p) for p in keep}
        for param in model.parameters():
            if id(param) not in kept:
                param.requires_grad_(False)
        self.model = model
        self._trainable = [p for p in keep if p.requires_grad]
        self.ras = None
        if config.decoder_noise_ras:
            self.ras = ras_from(config, data, set(data.manifest.languages))
        self.validation = PretrainingValidation(config, data, self.loader_max_len())

    def _load_codebook(self, model: SemFaceModel) -> None:
        """The frozen VQ layer of an encoder-stage run, cut for this model-parallel rank."""
        source = self.config.init_from
        assert source is not None  # TrainConfig requires it for the VQ decoder stage
        codebook = load_codebook(source)  # a run, a checkpoint or a pretraining model dir
        if codebook.meta.get("vocab_sha256") != self.data.tokenizer.sha256:
            raise ValueError(f"{source} was trained with another SentencePiece model")
        model.interface.load_trained(codebook.for_rank(self.groups.mp_rank, self.groups.mp_size))
        self.parent_runs["encoder"] = codebook.meta.get("mlflow_run_id") or ""

    def trainable(self) -> list[nn.Parameter]:
        return self._trainable

    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        engine.module.interface.set_step(step)
        sentences = self.sequence_batch(batch)
        self.body_flops = model_flops.semface_step(
            self.model_config,
            interface=self.config.interface,
            stage=self.config.stage,
            decoder_codes=self.config.decoder_codes,
            batch=batch.tokens.shape[0],
            length=batch.tokens.shape[1],
            tokens=batch.num_tokens,
        )
        if self.ras is None:
            return engine.forward(sentences, generator)
        # The decoder stage's copy C(x) is noised from the substituted sentences; the
        # encoder stage and the decoder's targets keep the sentences as they are.
        substituted, figures = substitute(
            self.ras, sentences, batch.lang, generator, self.loader_max_len()
        )
        out = engine.forward(sentences, generator, substituted)
        out.metrics.update(figures)
        return out

    def health(self, engine: DeepSpeedEngine, step: int) -> dict[str, float]:
        """The interface's health over the logging window, and its warnings on rank 0 (a VQ
        codebook whose argmax falls into a few codes)."""
        interface = engine.module.interface
        figures = interface.health()
        if rank() == 0:
            share = self.config.codebook_warn_fraction
            for warning in interface.health_warnings(figures, codes_share=share, step=step):
                print(warning, flush=True)
        return figures

    def health_fields(self, figures: dict[str, float]) -> list[str]:
        return self.model.interface.health_fields(figures)

    def after_step(self, engine: DeepSpeedEngine, step: int, tracker: Tracker) -> None:
        if self.validation.due(step):
            self.validation.run(engine, step, tracker)

    def meta(self, engine: DeepSpeedEngine) -> dict[str, Any]:
        interface = engine.module.interface
        with engine.gathered(interface.parameters()):  # the fingerprint hashes the weights
            return {"interface": interface.fingerprint()}


class DenoisingUnit(_MonolingualUnit):
    """``--stage mbart``: the sequence-to-sequence model reconstructs noised text."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        processor = data.tokenizer.processor
        pieces = [processor.id_to_piece(i) for i in range(len(data.tokenizer))]
        self.model = DenoisingSeq2Seq(
            self.model_config,
            data.special,
            objective_config_from(config),
            tuple(sentence_boundary_ids(pieces)),
        )

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        # The noised copy at the sentence's width (span infilling only shortens it).
        width = batch.tokens.shape[1]
        self.body_flops = model_flops.seq2seq_body(
            self.model_config, batch.tokens.shape[0], width, width
        )
        return engine.forward(self.sequence_batch(batch), generator)
