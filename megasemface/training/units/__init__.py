"""Train units by stage: what each stage contributes to the one training loop.

A new stage is a :class:`~megasemface.training.units.base.TrainUnit` subclass registered in
:data:`UNITS` under the name :func:`unit_name` gives its config; the loop is not touched.
"""

from __future__ import annotations

from collections.abc import Callable

from megasemface.distributed.groups import ParallelGroups
from megasemface.stages import stage
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.units.base import TrainUnit
from megasemface.training.units.fusion import FusionUnit
from megasemface.training.units.mrasp import MraspUnit
from megasemface.training.units.pretraining import DenoisingUnit, SemFaceUnit
from megasemface.training.units.translation import SupervisedUnit, UnsupervisedUnit
from megasemface.training.units.veco import VecoUnit

__all__ = ["UNITS", "TrainUnit", "build_unit", "unit_name"]

UnitFactory = Callable[[TrainConfig, RunData, ParallelGroups], TrainUnit]

UNITS: dict[str, UnitFactory] = {
    "encoder": SemFaceUnit,
    "decoder": SemFaceUnit,
    "joint": SemFaceUnit,
    "mbart": DenoisingUnit,
    "mrasp": MraspUnit,
    "veco": VecoUnit,
    "finetune-supervised": SupervisedUnit,
    "finetune-unsupervised": UnsupervisedUnit,
    "finetune-fusion": FusionUnit,
}


def unit_name(config: TrainConfig) -> str:
    """The stage, and for fine-tuning its mode: the key of :data:`UNITS`."""
    return (
        f"{config.stage}-{config.finetune_mode}" if stage(config.stage).finetunes else config.stage
    )


def build_unit(config: TrainConfig, data: RunData, groups: ParallelGroups) -> TrainUnit:
    """The unit of ``config``'s stage, its model built (seed torch first: it initialises)."""
    return UNITS[unit_name(config)](config, data, groups)
