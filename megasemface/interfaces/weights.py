"""An interface's own trained weights in a model's state, across model-parallel sizes.

An interface whose weights train and may be split over model-parallel ranks (VQ-SemFace's
codebook) gives its :class:`~megasemface.interfaces.registry.Interface` record a
:class:`TrainedWeights`. The checkpoint tools consolidate, average, connect and export a
model state, and hand an encoder stage's weights to a later stage, through it alone: they
never read what the weights are. An interface without one keeps nothing of its own that
trains (CL-SemFace's table is fixed): its weights are the model's like any other.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from megasemface.nn.config import ModelConfig

__all__ = ["StateDict", "TrainedWeights"]

StateDict = Mapping[str, Tensor]
"""A model's (or one model-parallel rank's) tensors by state-dict key."""


class TrainedWeights(abc.ABC):
    """How an interface's trained weights sit in a whole model's state dict."""

    prefix: ClassVar[str]
    """The model state-dict prefix of the interface's own weights."""
    noun: ClassVar[str]
    """What the weights are, in messages (``codebook``)."""

    def own_state(self, state: StateDict) -> dict[str, Tensor]:
        """The interface's entries of a model state, keyed as its own module loads them."""
        n = len(self.prefix)
        return {k[n:]: v for k, v in state.items() if k.startswith(self.prefix)}

    @abc.abstractmethod
    def split_keys(self, config: ModelConfig) -> tuple[str, ...]:
        """Model state-dict keys that several model-parallel ranks each hold a part of
        (none: every rank holds the whole)."""

    @abc.abstractmethod
    def split(self, state: StateDict, config: ModelConfig, mp_rank: int, mp_size: int) -> dict:
        """Model-parallel rank ``mp_rank``'s view of a full model state (other keys shared;
        a state of the interface's entries alone gives that rank's part of them).

        Raises:
            ValueError: weights that ``mp_size`` ranks cannot share equally.
        """

    def resplit(self, state: StateDict, config: ModelConfig, mp_size: int) -> list[dict]:
        """A full model state cut for ``mp_size`` model-parallel ranks, in rank order; only
        the split keys are copied."""
        if mp_size < 1:
            raise ValueError(f"the model-parallel size must be >= 1, got {mp_size}")
        return [self.split(state, config, rank, mp_size) for rank in range(mp_size)]

    @abc.abstractmethod
    def gather(self, states: Sequence[StateDict], config: ModelConfig) -> dict[str, Tensor]:
        """The full model state from the model-parallel ranks' states, in rank order.

        Raises:
            ValueError: parts that do not make the weights ``config`` describes.
        """

    @abc.abstractmethod
    def fingerprint(
        self, state: StateDict, config: ModelConfig, dtype: torch.dtype, mp_size: int = 1
    ) -> dict[str, Any]:
        """The fingerprint model-parallel rank 0 of a live model holding these weights
        records (the one meta.json keeps): ``state`` holds rank 0's model-level entries of
        ``mp_size`` ranks, and ``dtype`` is the dtype the run held parameters in.

        Raises:
            ValueError: weights whose names or shapes are not those ``config`` describes.
        """
