"""The VQ codebook across model-parallel sizes: gathering, re-splitting, fingerprints.

A flat VQ layer splits ``interface.quantizer.{logits_weight, logits_bias, codebook}`` along
dim 0 over the model-parallel group (rank r holds rows ``[r K/m, (r+1) K/m)``); everything
else is replicated. A product-layout layer is replicated on every rank, so gathering takes
rank 0's copy and splitting copies it.

Fingerprints: ``VectorQuantizedInterface.fingerprint()`` hashes the layer's parameters as the
live model holds them (in the training dtype, e.g. bf16) and, when the table is split, only
the local shard. :meth:`CodebookWeights.fingerprint` recomputes that hash for given weights
as a model of any model-parallel size would, so a gathered codebook gets the fingerprint a
model-parallel-size-1 run holding it records.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq.shards import (
    SPLIT_PARAMETERS,
    gather_codebook,
    split_codebook,
)
from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
from megasemface.interfaces.weights import StateDict, TrainedWeights
from megasemface.nn.config import ModelConfig

__all__ = ["QUANTIZER_PREFIX", "SPLIT_KEYS", "CodebookWeights"]

QUANTIZER_PREFIX = "interface.quantizer."
SPLIT_KEYS: tuple[str, ...] = tuple(QUANTIZER_PREFIX + name for name in SPLIT_PARAMETERS)
"""Model state-dict keys of a flat VQ layer that are split across model-parallel ranks."""


def _check_divisible(rows: int, mp_size: int) -> None:
    if rows % mp_size:
        raise ValueError(
            f"the codebook's {rows} codes cannot be split over {mp_size} model-parallel ranks "
            "(vq.num_codes must be divisible by --mp-size)"
        )


class CodebookWeights(TrainedWeights):
    """VQ-SemFace's quantizer: the codebook, its code logits and their split."""

    prefix = QUANTIZER_PREFIX
    noun = "codebook"

    def split_keys(self, config: ModelConfig) -> tuple[str, ...]:
        return SPLIT_KEYS if config.vq.layout == "flat" else ()

    def split(self, state: StateDict, config: ModelConfig, mp_rank: int, mp_size: int) -> dict:
        if mp_size < 1 or not 0 <= mp_rank < mp_size:
            raise ValueError(f"invalid model-parallel rank {mp_rank} of size {mp_size}")
        keys = self.split_keys(config) if mp_size > 1 else ()
        for key in keys:
            if key in state:
                _check_divisible(state[key].shape[0], mp_size)
        return {
            k: split_codebook(v, mp_rank, mp_size) if k in keys else v for k, v in state.items()
        }

    def gather(self, states: Sequence[StateDict], config: ModelConfig) -> dict[str, Tensor]:
        if not states:
            raise ValueError("no model-parallel states to gather")
        keys = self.split_keys(config) if len(states) > 1 else ()
        full = {
            k: gather_codebook([s[k] for s in states]) if k in keys else v
            for k, v in states[0].items()
        }
        gathered = [k for k in keys if k in full]
        if gathered and full[gathered[-1]].shape[0] != config.vq.num_codes:
            raise ValueError(
                f"the gathered codebook has {full[gathered[-1]].shape[0]} codes, the model "
                f"config {config.vq.num_codes}"
            )
        return full

    def fingerprint(
        self, state: StateDict, config: ModelConfig, dtype: torch.dtype, mp_size: int = 1
    ) -> dict[str, Any]:
        """The value of ``VectorQuantizedInterface.fingerprint()``, which hashes the
        concatenation of the layer's parameters in registration order; here the hash is fed
        one tensor at a time, in the order of a layer built on the meta device (no memory),
        so fp32 weights are never copied (the interface's own method concatenates them and
        copies the result)."""
        single = ParallelGroups.single()
        groups = dataclasses.replace(single, mp_size=mp_size, mp_ranks=tuple(range(mp_size)))
        with torch.device("meta"):
            interface = VectorQuantizedInterface(config, groups, seed=0)
        layer = interface.quantizer
        weights = self.own_state(state)
        expected = dict(layer.named_parameters())
        if sorted(weights) != sorted(expected):
            raise ValueError(
                f"the VQ layer has parameters {sorted(expected)}, the state {sorted(weights)}"
            )
        digest = hashlib.sha256()
        for name, param in expected.items():
            value = weights[name]
            if value.shape != param.shape:
                raise ValueError(
                    f"{QUANTIZER_PREFIX}{name} has shape {tuple(value.shape)}, the model config "
                    f"at model-parallel size {mp_size} needs {tuple(param.shape)}"
                )
            digest.update(value.detach().to(dtype).to(torch.float32).contiguous().numpy())
        return {
            "kind": interface.kind,
            "layout": layer.config.layout,
            "codes": layer.config.combinations,
            "d_model": layer.d_model,
            "quantizer_sha256": digest.hexdigest(),
            "mp_rank": 0,
        }
