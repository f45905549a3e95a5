"""The train unit: what one stage contributes to the training loop.

The loop (:class:`megasemface.training.trainer.Trainer`) reads batches, seeds every step,
agrees on skipped steps and signals, steps the optimizer, logs and checkpoints; it knows
nothing of stages. A unit owns the rest: the model and which of its parameters train, the
loss of a batch, the stage's health figures and its work between steps (validation), the
counters it keeps in checkpoints and what it adds to a checkpoint's metadata. The engine is
passed to every call that runs the model, since the model runs through DeepSpeed.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource, TokenBatch
from megasemface.data.text.ras import RandomAlignedSubstitution, RasDictionary
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.registry import interface
from megasemface.nn.config import ModelConfig, apply_overrides
from megasemface.objectives.objective import ObjectiveConfig, StageOutput
from megasemface.objectives.options import PretrainingOptions
from megasemface.objectives.sequences import SequenceBatch
from megasemface.tracking.tracker import Tracker
from megasemface.training import model_flops
from megasemface.training.options import (
    TrainConfig,
    section_of,
    user_model_config,
    user_model_keys,
)
from megasemface.training.run_data import RunData

__all__ = [
    "TrainUnit",
    "loader_workers",
    "model_config_from",
    "objective_config_from",
    "rank_loader",
    "ras_from",
    "substitute",
]


def model_config_from(config: TrainConfig, data: RunData) -> ModelConfig:
    """The model shape of a run that starts from no model directory: the preset and the
    user's options, with the sizes and special ids of the run's tokenizer."""
    tokenizer = data.tokenizer
    sizes: dict[str, Any] = {
        "vocab_size": tokenizer.vocab_size,
        "num_langs": len(data.languages),
        "pad_id": tokenizer.pad_id,
        "mask_id": tokenizer.mask_id,
    }
    given = user_model_keys(config)
    user = user_model_config(config)
    for key, value in sizes.items():
        if key in given and getattr(user, key) != value:
            raise ValueError(
                f"--model {key}={getattr(user, key)} contradicts {config.spm_model}, whose "
                f"{key} is {value}; leave it out: the tokenizer sets it"
            )
    return apply_overrides(user, list(sizes.items()))


def loader_workers(config: TrainConfig) -> int:
    """``--num-workers``, or without it one worker per rank on a GPU and 0 on the CPU. The
    data order is the same either way: a run reads max(1, workers) slots per rank."""
    if config.num_workers is not None:
        return config.num_workers
    from megasemface.distributed.engine import accelerator_device

    return 1 if accelerator_device().type == "cuda" else 0


def rank_loader(
    config: TrainConfig,
    data: RunData,
    groups: ParallelGroups,
    *,
    max_len: int,
    languages: tuple[str, ...] = (),
    pair_share: float | None = None,
) -> ShardLoader:
    """Batches of ``languages`` of the run's shards (empty: all) for this data-parallel
    rank, of ``--max-tokens`` tokens each, in the order the run's seed decides."""
    return ShardLoader(
        ShardSource.from_manifest(data.manifest),
        LoaderConfig(
            max_tokens=config.max_tokens,
            max_len=max_len,
            pair_share=pair_share,
            languages=languages,
            seed=config.seed,
            num_workers=loader_workers(config),
        ),
        pad_id=data.tokenizer.pad_id,
        rank=groups.dp_rank,
        world_size=groups.dp_size,
    )


def objective_config_from(config: TrainConfig) -> ObjectiveConfig:
    """The pre-training losses' options and weights."""
    options = section_of(config, PretrainingOptions)
    if options.mse_weight is None and config.cl_unit_mse:
        # Eq. 1 at the unit scale is bounded at any width: weight 1, as the paper's.
        options.mse_weight = 1.0
    section = interface(config.interface).options
    weights = section_of(config, section).loss_weights() if section else {}
    return ObjectiveConfig(**dataclasses.asdict(options), interface_weights=weights)


def ras_from(
    config: TrainConfig, data: RunData, langs: set[str]
) -> RandomAlignedSubstitution | None:
    """The run's random aligned substitution, from ``--ras-dictionary``, for sentences in
    ``langs``; None without a dictionary or at probability 0.

    Raises:
        ValueError: a dictionary cannot be read, or has no word of one of ``langs``.
    """
    if not config.ras_dictionary or config.ras_prob == 0:
        return None
    dictionary = RasDictionary.load(config.ras_dictionary, data.tokenizer)
    missing = sorted(lang for lang in langs if dictionary.size(lang) == 0)
    if missing:
        files = ", ".join(map(str, config.ras_dictionary))
        raise ValueError(
            f"--ras-dictionary {files}: no word of {missing} has a translation the tokenizer "
            "can encode; pass a dictionary of the data's languages"
        )
    return RandomAlignedSubstitution(dictionary, data.tokenizer, config.ras_prob)


def substitute(
    ras: RandomAlignedSubstitution,
    batch: SequenceBatch,
    lang: str,
    generator: torch.Generator,
    max_length: int,
) -> tuple[SequenceBatch, dict[str, float]]:
    """``batch`` (in ``lang``) with random aligned substitution, and its figures: the share
    of words with a translation (``ras_dictionary_words``) and of words replaced
    (``ras_replaced``)."""
    result = ras(batch.tokens_BT, batch.lengths_B, lang, generator, max_length)
    words = max(result.words, 1)
    figures = {
        "ras_dictionary_words": result.candidates / words,
        "ras_replaced": result.replaced / words,
    }
    return SequenceBatch(result.tokens_BT, result.lengths_B, batch.langs_B), figures


class TrainUnit(abc.ABC):
    """One stage of training: built from the run's config, data and parallel groups."""

    lr_schedule: ClassVar[str] = "deepspeed"
    """The learning-rate schedule when ``--lr-schedule`` is not given."""

    model: nn.Module
    """The module the engine wraps; its ``forward`` is what :meth:`loss` calls."""
    model_config: ModelConfig
    body_flops: float = 0.0
    """Model FLOPs of the last :meth:`loss`'s step but its output layers, from the shapes it
    ran at (:mod:`megasemface.training.model_flops`); each unit's :meth:`loss` sets it."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        self.config = config
        self.data = data
        self.groups = groups
        self.parent_runs: dict[str, str] = {}
        """MLflow run ids of the runs this one starts from, by stage name."""

    @abc.abstractmethod
    def trainable(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (the rest are frozen or not trained here)."""

    def loader_max_len(self) -> int:
        """The longest sample the loader yields: room for ``</s>`` and the language tag."""
        return self.model_config.max_len - 2

    def loader_languages(self) -> tuple[str, ...]:
        """The languages and pairs of the shards the run's loader reads (empty: all)."""
        return ()

    def loader_pair_share(self) -> float | None:
        """The share of batches drawn from language pairs when the shards hold pairs and
        single languages (None: the loader's temperature over all; ``LoaderConfig``)."""
        return None

    @abc.abstractmethod
    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        """The loss of ``batch`` at ``step``; ``generator`` draws the step's masks and noise."""

    def flops(self, out: StageOutput) -> float:
        """Model FLOPs of the step :meth:`loss` returned ``out`` for, forward and backward:
        its body and the output layers over its predicted tokens (host values only)."""
        return self.body_flops + model_flops.output_layer(self.model_config, out.num_targets)

    def health(self, engine: DeepSpeedEngine, step: int) -> dict[str, float]:
        """Figures over the logging window, logged with the losses (a collective)."""
        return {}

    def health_fields(self, figures: dict[str, float]) -> list[str]:
        """Short fields of the progress line from the logged ``figures`` (:meth:`health`'s
        among them); none by default."""
        del figures
        return []

    def after_step(  # noqa: B027 (an optional hook)
        self, engine: DeepSpeedEngine, step: int, tracker: Tracker
    ) -> None:
        """Runs on every rank after each step, before any checkpoint (validation)."""

    def after_training(  # noqa: B027 (an optional hook)
        self, engine: DeepSpeedEngine, tracker: Tracker
    ) -> None:
        """Runs on every rank once the last step is done and saved (registering a model)."""

    def run_tags(self) -> dict[str, str]:
        """Tags of the run's MLflow run that describe the model: its semantic interface."""
        return {"interface": self.config.interface}

    def meta(self, engine: DeepSpeedEngine) -> dict[str, Any]:
        """What the stage adds to a checkpoint's metadata; at least ``interface``, the
        fingerprint of its semantic interface (a collective under ZeRO-3)."""
        return {"interface": {"kind": self.config.stage}}

    def state_dict(self) -> dict[str, Any]:
        """Counters the stage keeps in checkpoints (JSON values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """Restores :meth:`state_dict` from a checkpoint's client state."""

    def rank_state(self) -> dict[str, Any]:
        """What the stage keeps per rank in checkpoints (JSON values): the positions of
        loaders of its own besides the run's."""
        return {}

    def load_rank_states(self, states: list[dict[str, Any]]) -> None:  # noqa: B027 (optional)
        """Restores :meth:`rank_state` from the states of all the run's ranks (on another
        number of ranks, this one continues what others read)."""
