"""CL-SemFace's own options (train.py's ``--cl-*``): the cross-lingual table and how the
encoder reads and trains it. None: chosen by the run's stage
(:func:`megasemface.training.interface_options.fill_interface_options`). Torch-free: parsing
options reads it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

__all__ = ["CrossLingualOptions"]


@dataclasses.dataclass(kw_only=True)
class CrossLingualOptions:
    """The options of the ``cl`` interface."""

    cl_table: Path | None = None
    """CL-SemFace: the cross-lingual embedding table (safetensors,
    tools/build_cl_embeddings.py)."""
    cl_trainable: bool | None = None
    """CL-SemFace: train the table with the encoder, as Algorithm 1 updates the interface
    (--no-cl-trainable: the table stays as built). Default: on in the joint stage
    (docs/reproduce.md), off in the separate stages, whose decoder stage reads --cl-table."""
    cl_unit_logits: bool | None = None
    """CL-SemFace: the encoder's MLM output layer reads the table's rows divided by
    sqrt(d_model), at the unit norm of the VecMap embeddings the paper ties there; the rows
    as they are (--no-cl-unit-logits) give logits of d_model times a cosine and an MLM loss
    at chance. Default: on in the encoder and joint stages (docs/reproduce.md)."""
    cl_unit_mse: bool | None = None
    """CL-SemFace: Eq. 1's MSE pulls the encoder's activations before its final LayerNorm to
    the table's rows divided by sqrt(d_model), unit vectors as the paper's VecMap
    embeddings are (weight 1 by default). Off (the default): to the rows as they are, at
    norm sqrt(d_model), the scale of the encoder's activations; the distance then grows with
    the width, so its weight defaults to 1 up to d_model 128 and 0.01 wider."""
    cl_table_input: bool | None = None
    """CL-SemFace: the encoder's input token embeddings start as the table's rows at unit
    norm (XLM's code ties them to the output layer the paper initialises with the table).
    Default: on in the encoder and joint stages (docs/reproduce.md). VQ-SemFace with
    --vq-codebook-init table: off by default; on, its encoder's embeddings, and so its tied
    MLM output layer, start from the table too."""

    def loss_weights(self) -> dict[str, float]:
        """Its loss term's weight is the pre-training losses' ``mse_weight``, which depends
        on the model's width (``default_mse_weight``): none here."""
        return {}

    @staticmethod
    def add_arguments(add: Callable[..., None]) -> None:
        """Adds the section's flags with ``add`` (``OptionSection``)."""
        add("--cl-table", type=Path)
        # None unless given: the stage chooses (fill_interface_options).
        for flag in ("--cl-trainable", "--cl-unit-logits", "--cl-unit-mse", "--cl-table-input"):
            add(flag, action=argparse.BooleanOptionalAction, default=None)
