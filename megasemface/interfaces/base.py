"""The semantic interface abstraction, and the XLM-style baseline with no interface.

An interface does two things, one per stage:

- encoder stage: turn the encoder's output into the features its MLM output layer reads,
  with any auxiliary losses (CL-SemFace: MSE to the cross-lingual embeddings; VQ-SemFace:
  quantisation, diversity and L2 losses);
- decoder stage: turn a (noised) sentence into the memory the decoder cross-attends to,
  standing in for the encoder output (CL-SemFace: fixed cross-lingual embeddings; VQ-SemFace:
  codes of a frozen codebook).

The decoder never branches on the interface type: it only sees ``InterfaceMemory``.
Shapes: B batch, T length, N selected tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any, ClassVar

import torch
from torch import nn

from megasemface.nn.transformer import EncoderOutput, TransformerEncoder

__all__ = [
    "EncoderHeadOutput",
    "InterfaceMemory",
    "NoInterface",
    "SemanticInterface",
    "tensor_sha256",
]


@dataclasses.dataclass
class EncoderHeadOutput:
    features_ND: torch.Tensor
    """Features the MLM output layer reads, at the N positions with a target."""
    losses: dict[str, torch.Tensor]
    """Unweighted auxiliary losses by name (mse, diversity, l2)."""
    metrics: dict[str, float | torch.Tensor]
    """For logging; tensors are detached scalars, read only when a step logs."""


@dataclasses.dataclass
class InterfaceMemory:
    memory_BSD: torch.Tensor
    """What the decoder cross-attends to, in place of the encoder output."""
    mask_BS: torch.Tensor
    metrics: dict[str, float | torch.Tensor]
    losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Unweighted auxiliary losses of the decoder side (VQ: the extractor's diversity and
    token entropy); the objective decides whether they train the extractor."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """A stable hash of a tensor's values (as fp32), for interface fingerprints."""
    data = tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class SemanticInterface(nn.Module, abc.ABC):
    """What joins the separately pre-trained encoder and decoder."""

    kind: ClassVar[str]

    @abc.abstractmethod
    def encoder_head(self, encoded: EncoderOutput, targets_BT: torch.Tensor) -> EncoderHeadOutput:
        """Features for the MLM output layer at positions where ``targets_BT != -100``."""

    @abc.abstractmethod
    def output_embeddings(self, encoder: TransformerEncoder) -> torch.Tensor:
        """The [V, D] matrix of the encoder's MLM output layer."""

    @abc.abstractmethod
    def decoder_memory(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> InterfaceMemory:
        """The decoder's cross-attention memory for a (noised) sentence."""

    def features_memory(
        self, features_BTD: torch.Tensor, mask_BT: torch.Tensor, tokens_BT: torch.Tensor
    ) -> InterfaceMemory:
        """The interface's memory of the encoder's outputs ``features`` for ``tokens``,
        instead of its own reading of the tokens: a VQ codebook quantises the outputs,
        CL-SemFace gives the table rows Eq. 1 pulls them to."""
        raise ValueError(f"the {self.kind!r} interface reads tokens, not features")

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """Type, shapes and content hash: later stages refuse an interface that differs."""

    @property
    def has_decoder_stage(self) -> bool:
        return True

    def initialise_encoder(self, encoder: TransformerEncoder) -> None:
        """Sets the new encoder's starting weights from the interface; by default none."""
        del encoder

    def health(self) -> dict[str, float]:
        """The interface's own health figures over the steps since the last call, then a new
        window (VQ-SemFace: the codes the model picks). A collective over the data-parallel
        group: every rank calls it at the same step."""
        return {}

    def external_parameters(self) -> list[nn.Parameter]:
        """Weights read by the interface's methods rather than inside the forward of the
        sub-module that owns them; ZeRO-3 must gather these for the whole model forward."""
        return list(self.parameters())


def select_targets(hidden_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Rows of [B, T, D] at the positions with a target, as [N, D]."""
    return hidden_BTD[targets_BT != -100]


class NoInterface(SemanticInterface):
    """The XLM baseline: the encoder is trained with MLM alone, and its weights later
    initialise both encoder and decoder; cross-attention starts random."""

    kind = "none"

    def encoder_head(self, encoded: EncoderOutput, targets_BT: torch.Tensor) -> EncoderHeadOutput:
        return EncoderHeadOutput(select_targets(encoded.hidden_BTD, targets_BT), {}, {})

    def output_embeddings(self, encoder: TransformerEncoder) -> torch.Tensor:
        return encoder.embed.tokens.weight  # tied, as in XLM

    def decoder_memory(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> InterfaceMemory:
        raise ValueError(
            "the XLM-style baseline has no decoder stage: its encoder initialises the decoder "
            "when the stages are connected"
        )

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @property
    def has_decoder_stage(self) -> bool:
        return False
