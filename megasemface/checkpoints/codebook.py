"""The VQ codebook across model-parallel sizes: gathering, re-splitting, fingerprints.

A flat VQ layer splits ``interface.quantizer.{logits_weight, logits_bias, codebook}`` along
dim 0 over the model-parallel group (rank r holds rows ``[r K/m, (r+1) K/m)``); everything
else is replicated. These functions work on whole model state dicts (``interface.quantizer.``
keys) with the shard helpers of :mod:`megasemface.interfaces.vq.gumbel_quantizer`. A
product-layout layer is replicated on every rank, so gathering takes rank 0's copy and
splitting copies it.

Fingerprints: ``VectorQuantizedInterface.fingerprint()`` hashes the layer's parameters as the
live model holds them (in the training dtype, e.g. bf16) and, when the table is split, only
the local shard. :func:`vq_fingerprint` recomputes that hash for given weights as a model of
any model-parallel size would, so a gathered codebook gets the fingerprint a
model-parallel-size-1 run holding it records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq.gumbel_quantizer import (
    SPLIT_PARAMETERS,
    gather_codebook,
    split_codebook,
)
from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
from megasemface.nn.config import ModelConfig

__all__ = [
    "QUANTIZER_PREFIX",
    "SPLIT_KEYS",
    "gather_codebook_states",
    "quantizer_state",
    "resplit_codebook",
    "split_model_state",
    "tensor_digest",
    "vq_fingerprint",
]

QUANTIZER_PREFIX = "interface.quantizer."
SPLIT_KEYS: tuple[str, ...] = tuple(QUANTIZER_PREFIX + name for name in SPLIT_PARAMETERS)
"""Model state-dict keys of a flat VQ layer that are split across model-parallel ranks."""


def quantizer_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The VQ layer's entries of a model state, keyed as ``quantizer.load_state_dict`` wants."""
    n = len(QUANTIZER_PREFIX)
    return {k[n:]: v for k, v in state.items() if k.startswith(QUANTIZER_PREFIX)}


def split_model_state(
    state: Mapping[str, Tensor], mp_rank: int, mp_size: int, *, layout: str = "flat"
) -> dict[str, Tensor]:
    """Model-parallel rank ``mp_rank``'s view of a full model state (other keys shared)."""
    if layout != "flat" or mp_size == 1:
        return dict(state)
    return {
        k: split_codebook(v, mp_rank, mp_size) if k in SPLIT_KEYS else v for k, v in state.items()
    }


def resplit_codebook(
    state: Mapping[str, Tensor], mp_size: int, *, layout: str = "flat"
) -> list[dict[str, Tensor]]:
    """A full (gathered) model state cut for ``mp_size`` model-parallel ranks, in rank order.

    Only the split keys are copied; replicated tensors are shared between the returned dicts.
    """
    if mp_size < 1:
        raise ValueError(f"the model-parallel size must be >= 1, got {mp_size}")
    if layout == "flat":
        for key in SPLIT_KEYS:
            if key in state and state[key].shape[0] % mp_size:
                raise ValueError(
                    f"{key} has {state[key].shape[0]} rows, which {mp_size} model-parallel "
                    "ranks cannot share equally (vq.num_codes must be divisible by --mp-size)"
                )
    return [split_model_state(state, r, mp_size, layout=layout) for r in range(mp_size)]


def gather_codebook_states(
    states: Sequence[Mapping[str, Tensor]], *, layout: str = "flat"
) -> dict[str, Tensor]:
    """The full model state from the model-parallel ranks' states, listed in rank order."""
    if not states:
        raise ValueError("no model-parallel states to gather")
    if layout != "flat" or len(states) == 1:
        return dict(states[0])
    return {
        k: gather_codebook([s[k] for s in states]) if k in SPLIT_KEYS else v
        for k, v in states[0].items()
    }


def tensor_digest(tensor: Tensor) -> str:
    """``tensor_sha256`` (sha256 of the fp32 values) without copying an fp32 CPU tensor."""
    return hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy()).hexdigest()


def vq_fingerprint(
    state: Mapping[str, Tensor],
    model_config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    mp_rank: int = 0,
    mp_size: int = 1,
) -> dict[str, Any]:
    """The interface fingerprint a live model holding these VQ weights records.

    ``state`` holds model-level ``interface.quantizer.*`` tensors: the full layer for
    ``mp_size`` 1, rank ``mp_rank``'s shard otherwise. ``dtype`` is the dtype the training
    run held parameters in (the hash is over those values). The value is that of
    ``VectorQuantizedInterface.fingerprint()``, which hashes the concatenation of the
    layer's parameters in registration order; here the hash is fed one tensor at a time,
    in the order of a layer built on the meta device (no memory), so fp32 weights are
    never copied (the interface's own method concatenates them and copies the result).
    """
    groups = ParallelGroups(
        mp_group=None,
        dp_group=None,
        mp_rank=mp_rank,
        mp_size=mp_size,
        dp_rank=0,
        dp_size=1,
        mp_ranks=tuple(range(mp_size)),
    )
    with torch.device("meta"):
        interface = VectorQuantizedInterface(model_config, groups, seed=0)
    layer = interface.quantizer
    weights = quantizer_state(state)
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
                f"{QUANTIZER_PREFIX}{name} has shape {tuple(value.shape)}, the model config at "
                f"model-parallel size {mp_size} needs {tuple(param.shape)}"
            )
        digest.update(value.detach().to(dtype).to(torch.float32).contiguous().numpy())
    return {
        "kind": interface.kind,
        "layout": layer.config.layout,
        "codes": layer.config.combinations,
        "d_model": layer.d_model,
        "quantizer_sha256": digest.hexdigest(),
        "mp_rank": mp_rank,
    }
