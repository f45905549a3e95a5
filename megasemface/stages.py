"""The training stages and fine-tuning modes, by name: what each trains, reads and checks.

Every module that needs to know about a stage asks :func:`stage` for its :class:`Stage`
instead of comparing its name, and :func:`finetune_mode` for a :class:`FinetuneMode`. Each
names its train unit as ``module:Class`` (a stage that fine-tunes, its mode's), which
``training/units`` imports when a run builds it. Nothing here imports torch: parsing
options reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar

__all__ = [
    "FINETUNE_MODES",
    "STAGES",
    "FinetuneMode",
    "Stage",
    "add_record",
    "find_stage",
    "finetune_mode",
    "finetune_mode_names",
    "register_finetune_mode",
    "register_stage",
    "stage",
    "stage_names",
]

OptionCheck = Callable[[Any], None]
"""Checks a run's options (a ``TrainConfig``) that concern one stage or interface; raises
``ValueError`` with the message the command line prints."""


_Record = TypeVar("_Record")


def _no_check(options: Any) -> None:
    del options


def add_record(records: dict[str, _Record], name: str, record: _Record, what: str) -> _Record:
    """Adds ``record`` to a registry under ``name``, which names one record only."""
    if name in records:
        raise ValueError(f"{what} {name!r} is registered already")
    records[name] = record
    return record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One training stage: a ``--stage`` value and the ``stage`` of its checkpoints."""

    name: str
    unit: str | None
    """Its train unit, ``module:Class`` (None: a stage that fine-tunes runs its mode's)."""
    encoder: bool = False
    """Trains the SemFace encoder: MLM through the semantic interface."""
    decoder: bool = False
    """Trains the SemFace decoder: it reads the interface's memory."""
    seq2seq: bool = False
    """Trains a whole sequence-to-sequence model, which connects into a translation model
    as it is (mBART, mRASP, VECO)."""
    data: Literal["monolingual", "parallel", "mixed"] = "monolingual"
    """The pre-training shards: monolingual, parallel pairs (mRASP) or both in one
    directory (VECO)."""
    substitutes: bool = False
    """Substitutes dictionary words in every batch (random aligned substitution, mRASP)."""
    finetunes: bool = False
    """Fine-tunes a translation model (validation, the best model, back-translation)."""
    splits_codebook: bool = True
    """Its model may be split over model-parallel ranks (``--mp-size``)."""
    check: OptionCheck = _no_check
    """The stage's own checks of a run's options."""

    @property
    def semface(self) -> bool:
        """A SemFace stage: its model has a semantic interface."""
        return self.encoder or self.decoder

    @property
    def joint(self) -> bool:
        """Trains encoder and decoder together (Algorithm 1)."""
        return self.encoder and self.decoder


STAGES: dict[str, Stage] = {}
"""Every stage by name, in the order ``--stage`` lists them."""


def register_stage(spec: Stage) -> Stage:
    """Adds ``spec`` to :data:`STAGES`."""
    if (spec.unit is None) != spec.finetunes:
        raise ValueError(f"stage {spec.name!r}: a unit of its own, unless its modes have them")
    return add_record(STAGES, spec.name, spec, "stage")


def stage_names(where: Callable[[Stage], bool] = lambda spec: True) -> tuple[str, ...]:
    """The names of the stages ``where`` holds for, in registration order."""
    return tuple(name for name, spec in STAGES.items() if where(spec))


def find_stage(name: object) -> Stage | None:
    """The stage ``name``, None when it is none (a checkpoint's metadata may hold anything)."""
    return STAGES.get(name) if isinstance(name, str) else None


def stage(name: str) -> Stage:
    """The stage ``name``.

    Raises:
        ValueError: an unknown name, as ``--stage`` reports it.
    """
    spec = find_stage(name)
    if spec is None:
        raise ValueError(f"--stage must be one of {stage_names()}, got {name!r}")
    return spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneMode:
    """One way to fine-tune a translation model: a ``--finetune-mode`` value."""

    name: str
    unit: str
    """Its train unit, ``module:Class``."""
    monolingual: bool = False
    """Trains on monolingual text alone (denoising and back-translation), so every
    language of the pair needs a direction that translates into it."""
    substitutes: bool = False
    """May substitute dictionary words in the source of its pairs (``--finetune-ras``)."""


FINETUNE_MODES: dict[str, FinetuneMode] = {}
"""Every fine-tuning mode by name, in the order ``--finetune-mode`` lists them."""


def register_finetune_mode(spec: FinetuneMode) -> FinetuneMode:
    """Adds ``spec`` to :data:`FINETUNE_MODES`."""
    return add_record(FINETUNE_MODES, spec.name, spec, "fine-tuning mode")


def finetune_mode_names() -> tuple[str, ...]:
    """The fine-tuning modes' names, in registration order."""
    return tuple(FINETUNE_MODES)


def finetune_mode(name: str) -> FinetuneMode:
    """The fine-tuning mode ``name``.

    Raises:
        ValueError: an unknown name, as ``--finetune-mode`` reports it.
    """
    if name not in FINETUNE_MODES:
        raise ValueError(f"--finetune-mode must be one of {finetune_mode_names()}, got {name!r}")
    return FINETUNE_MODES[name]


_UNITS = "megasemface.training.units"


def _check_seq2seq_pretraining(options: Any) -> None:
    """mBART, mRASP and VECO pre-train a sequence-to-sequence model whose validation belongs
    to its fine-tuning (the SemFace stages validate their MLM and decoder losses)."""
    if options.valid_prefix is not None:
        raise ValueError(
            f"--stage {options.stage} pre-trains; validation belongs to its fine-tuning: connect "
            "the run (tools/merge_checkpoints.py connect --mbart RUN) and fine-tune with "
            "--valid-prefix"
        )


_SEMFACE_UNIT = f"{_UNITS}.pretraining:SemFaceUnit"
register_stage(Stage(name="encoder", unit=_SEMFACE_UNIT, encoder=True))
register_stage(Stage(name="decoder", unit=_SEMFACE_UNIT, decoder=True))
register_stage(Stage(name="joint", unit=_SEMFACE_UNIT, encoder=True, decoder=True))
register_stage(
    Stage(
        name="mbart",
        unit=f"{_UNITS}.pretraining:DenoisingUnit",
        seq2seq=True,
        check=_check_seq2seq_pretraining,
    )
)
register_stage(
    Stage(
        name="mrasp",
        unit=f"{_UNITS}.mrasp:MraspUnit",
        seq2seq=True,
        data="parallel",
        substitutes=True,
        splits_codebook=False,
        check=_check_seq2seq_pretraining,
    )
)
register_stage(
    Stage(
        name="veco",
        unit=f"{_UNITS}.veco:VecoUnit",
        seq2seq=True,
        data="mixed",
        splits_codebook=False,
        check=_check_seq2seq_pretraining,
    )
)
register_stage(Stage(name="finetune", unit=None, finetunes=True, splits_codebook=False))

register_finetune_mode(
    FinetuneMode(name="supervised", unit=f"{_UNITS}.translation:SupervisedUnit", substitutes=True)
)
register_finetune_mode(
    FinetuneMode(
        name="unsupervised", unit=f"{_UNITS}.translation:UnsupervisedUnit", monolingual=True
    )
)
register_finetune_mode(FinetuneMode(name="fusion", unit=f"{_UNITS}.fusion:FusionUnit"))
