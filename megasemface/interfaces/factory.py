"""Builds a semantic interface by name: ``none`` (XLM-style), ``cl`` or ``vq``."""

from __future__ import annotations

from pathlib import Path

import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.base import NoInterface, SemanticInterface
from megasemface.interfaces.cross_lingual import CrossLingualInterface, load_embedding_table
from megasemface.interfaces.vector_quantized import VectorQuantizedInterface
from megasemface.models.config import ModelConfig

__all__ = ["INTERFACES", "build_interface"]

INTERFACES = ("none", "cl", "vq")


def build_interface(
    kind: str,
    config: ModelConfig,
    *,
    groups: ParallelGroups | None = None,
    seed: int = 0,
    cl_table: torch.Tensor | str | Path | None = None,
    cl_trainable: bool = False,
    cl_unit_logits: bool = False,
) -> SemanticInterface:
    """The interface ``kind`` for a model of shape ``config``.

    ``cl`` needs ``cl_table``: a [vocab_size, d_model] tensor or a safetensors file of one.
    ``vq`` splits a flat codebook across ``groups``' model-parallel group.
    """
    if kind == "none":
        return NoInterface()
    if kind == "cl":
        if cl_table is None:
            raise ValueError("the cl interface needs a cross-lingual embedding table (--cl-table)")
        if not isinstance(cl_table, torch.Tensor):
            cl_table = load_embedding_table(cl_table, config.vocab_size, config.d_model)
        elif tuple(cl_table.shape) != (config.vocab_size, config.d_model):
            raise ValueError(
                f"cross-lingual table of shape {tuple(cl_table.shape)}, the model needs "
                f"[{config.vocab_size}, {config.d_model}]"
            )
        return CrossLingualInterface(cl_table, trainable=cl_trainable, unit_logits=cl_unit_logits)
    if kind == "vq":
        return VectorQuantizedInterface(config, groups or ParallelGroups.single(), seed)
    raise ValueError(f"unknown interface {kind!r}; choose one of {INTERFACES}")
