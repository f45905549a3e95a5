"""Builds a semantic interface by its registered name (``interfaces/registry.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.base import SemanticInterface
from megasemface.interfaces.registry import BuildOptions, find_interface, interface_names
from megasemface.interfaces.vq.options import VQOptions
from megasemface.nn.config import ModelConfig

__all__ = ["INTERFACE_PREFIX", "build_interface", "fingerprint_of_state"]


def build_interface(
    kind: str,
    config: ModelConfig,
    *,
    groups: ParallelGroups | None = None,
    seed: int = 0,
    cl_table: torch.Tensor | str | Path | None = None,
    cl_trainable: bool = False,
    cl_unit_logits: bool = False,
    cl_unit_mse: bool = False,
    cl_table_input: bool = False,
    vq_codebook_init: str = VQOptions.vq_codebook_init,
    piece_counts: Mapping[str, np.ndarray] | None = None,
) -> SemanticInterface:
    """The interface ``kind`` for a model of shape ``config``.

    ``cl`` needs ``cl_table``: a [vocab_size, d_model] tensor or a safetensors file of one.
    ``vq`` splits a flat codebook across ``groups``' model-parallel group; with
    ``vq_codebook_init`` ``table`` its codes start from ``cl_table``'s rows of the pieces
    ``piece_counts`` counts (interfaces/vq/table_codes.py).
    """
    spec = find_interface(kind)
    if spec is None:
        raise ValueError(f"unknown interface {kind!r}; choose one of {interface_names()}")
    options = BuildOptions(
        groups=groups,
        seed=seed,
        cl_table=cl_table,
        cl_trainable=cl_trainable,
        cl_unit_logits=cl_unit_logits,
        cl_unit_mse=cl_unit_mse,
        cl_table_input=cl_table_input,
        vq_codebook_init=vq_codebook_init,
        piece_counts=piece_counts,
    )
    return spec.build(config, options)


INTERFACE_PREFIX = "interface."
"""The model state-dict prefix of a SemFace stage's interface (``SemFaceModel.interface``)."""


def fingerprint_of_state(
    kind: str, config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, Any]:
    """The fingerprint of the interface ``kind`` whose weights ``state`` holds (a stage's
    model state, the interface's under ``interface.``), as a run in ``dtype`` computes it:
    of a state whose interface weights the run trained, averaged or gathered."""
    own = {
        k.removeprefix(INTERFACE_PREFIX): v
        for k, v in state.items()
        if k.startswith(INTERFACE_PREFIX)
    }
    spec = find_interface(kind)
    table = own.get("table") if spec is not None and spec.table else None
    interface = build_interface(kind, config, cl_table=table).to(dtype)
    interface.load_state_dict(own)
    return interface.fingerprint()
