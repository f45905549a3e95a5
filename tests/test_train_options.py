"""train.py's options: TrainConfig's fields and what it checks of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megasemface.training.options import TrainConfig, field_docs

PATHS = {"data": Path("shards/mono"), "spm_model": Path("spm/j.model"), "output_dir": Path("o")}


def test_options_the_units_read_are_checked_up_front() -> None:
    base = {"stage": "finetune", "interface": "none", **PATHS}
    with pytest.raises(ValueError, match="--direction takes SRC-TGT, got 'en'"):
        TrainConfig(directions=["en"], **base)
    with pytest.raises(ValueError, match="--denoise-schedule: schedule steps must increase"):
        TrainConfig(denoise_schedule="5:1,0:0", **base)
    with pytest.raises(ValueError, match="--num-workers must be >= 0"):
        TrainConfig(num_workers=-1, **base)


def test_every_field_has_a_docstring() -> None:
    assert set(field_docs()) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(doc and "\n" not in doc for doc in field_docs().values())
