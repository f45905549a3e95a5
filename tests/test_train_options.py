"""train.py's options: TrainConfig's fields and what it checks of them."""

from __future__ import annotations

import dataclasses

from megasemface.training.options import TrainConfig, field_docs


def test_every_field_has_a_docstring() -> None:
    assert set(field_docs()) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(doc and "\n" not in doc for doc in field_docs().values())
