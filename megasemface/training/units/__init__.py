"""Train units: what each stage, or fine-tuning mode, contributes to the one training loop.

A new stage is a :class:`~megasemface.training.units.base.TrainUnit` subclass that its
:class:`~megasemface.stages.Stage` (or :class:`~megasemface.stages.FinetuneMode`) names as
``module:Class``; the loop is not touched.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megasemface.distributed.groups import ParallelGroups
from megasemface.stages import finetune_mode, stage
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.units.base import TrainUnit

__all__ = ["TrainUnit", "build_unit", "unit_class", "unit_of"]

UnitFactory = Callable[[TrainConfig, RunData, ParallelGroups], TrainUnit]


def unit_of(config: TrainConfig) -> str:
    """The train unit of ``config``'s stage (for fine-tuning, of its mode) as ``module:Class``."""
    spec = stage(config.stage)
    return finetune_mode(config.finetune_mode).unit if spec.unit is None else spec.unit


def unit_class(path: str) -> type[TrainUnit]:
    """The train unit ``module:Class`` names."""
    module, _, name = path.partition(":")
    unit = getattr(importlib.import_module(module), name, None)
    if not (isinstance(unit, type) and issubclass(unit, TrainUnit)):
        raise ValueError(f"{path} names no train unit")
    return unit


def build_unit(config: TrainConfig, data: RunData, groups: ParallelGroups) -> TrainUnit:
    """The unit of ``config``'s stage, its model built (seed torch first: it initialises)."""
    return unit_class(unit_of(config))(config, data, groups)
