"""The training stages, by name: what each trains, reads and checks.

Every module that needs to know about a stage asks :func:`stage` for its :class:`Stage`
instead of comparing its name; its train unit is registered under the same name in
``training/units/__init__.py``. Nothing here imports torch: parsing options reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

__all__ = [
    "STAGES",
    "Stage",
    "find_stage",
    "register_stage",
    "stage",
    "stage_names",
]

OptionCheck = Callable[[Any], None]
"""Checks a run's options (a ``TrainConfig``) that concern one stage or interface; raises
``ValueError`` with the message the command line prints."""


def _no_check(options: Any) -> None:
    del options


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One training stage: a ``--stage`` value and the ``stage`` of its checkpoints."""

    name: str
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
    """Adds ``spec`` to :data:`STAGES`; its train unit is registered in ``training/units``."""
    if spec.name in STAGES:
        raise ValueError(f"stage {spec.name!r} is registered already")
    STAGES[spec.name] = spec
    return spec


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


def _check_seq2seq_pretraining(options: Any) -> None:
    """mBART, mRASP and VECO pre-train a sequence-to-sequence model whose validation belongs
    to its fine-tuning (the SemFace stages validate their MLM and decoder losses)."""
    if options.valid_prefix is not None:
        raise ValueError(
            f"--stage {options.stage} pre-trains; validation belongs to its fine-tuning: connect "
            "the run (tools/merge_checkpoints.py connect --mbart RUN) and fine-tune with "
            "--valid-prefix"
        )


register_stage(Stage(name="encoder", encoder=True))
register_stage(Stage(name="decoder", decoder=True))
register_stage(Stage(name="joint", encoder=True, decoder=True))
register_stage(Stage(name="mbart", seq2seq=True, check=_check_seq2seq_pretraining))
register_stage(
    Stage(
        name="mrasp",
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
        seq2seq=True,
        data="mixed",
        splits_codebook=False,
        check=_check_seq2seq_pretraining,
    )
)
register_stage(Stage(name="finetune", finetunes=True, splits_codebook=False))
