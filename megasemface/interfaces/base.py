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
    "EncoderTargets",
    "InterfaceMemory",
    "NoInterface",
    "SemanticInterface",
    "start_embeddings_from_table",
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


@dataclasses.dataclass
class EncoderTargets:
    """What the diagnostics compare the encoder's outputs with, at N tokens."""

    outputs_ND: torch.Tensor
    """The encoder's outputs where the interface reads them."""
    targets_ND: torch.Tensor
    """What the interface pulls them toward (VQ-SemFace: the code vector of the argmax code;
    CL-SemFace: the token's table row)."""
    codes_N: torch.Tensor | None = None
    """The codes the interface picks for them, without noise (None: it picks none)."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """A stable hash of a tensor's values (as fp32), for fingerprints and for comparing
    weights; a CPU fp32 tensor is hashed without a copy."""
    return hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy()).hexdigest()


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

    def set_step(self, step: int) -> None:
        """Advances the interface's own schedules to ``step`` (VQ-SemFace: the Gumbel
        temperature); by default it has none."""
        del step

    def load_trained(self, state: dict[str, torch.Tensor]) -> None:
        """Loads an encoder stage's trained interface weights (this model-parallel rank's
        part, as :class:`~megasemface.interfaces.weights.TrainedWeights` cuts them) and
        freezes them: the decoder stage reads them fixed."""
        del state
        raise ValueError(f"the {self.kind!r} interface has no trained weights to load")

    def health(self) -> dict[str, float]:
        """The interface's own health figures over the steps since the last call, then a new
        window (VQ-SemFace: the codes the model picks). A collective over the data-parallel
        group: every rank calls it at the same step."""
        return {}

    def health_warnings(
        self, figures: dict[str, float], *, codes_share: float, step: int
    ) -> list[str]:
        """Warnings on :meth:`health`'s ``figures`` at ``step`` (VQ-SemFace: a codebook whose
        choices collapsed onto fewer than ``codes_share`` of the codes a uniform choice
        picks); by default none."""
        del figures, codes_share, step
        return []

    def health_fields(self, figures: dict[str, float]) -> list[str]:
        """Short fields of the training's progress line from :meth:`health`'s ``figures``;
        none by default."""
        del figures
        return []

    def encoder_codes(self) -> torch.Tensor | None:
        """The noise-free codes of every token of the encoder head's last call, None for an
        interface that picks none."""
        return None

    def code_figures(self, codes: torch.Tensor) -> dict[str, float]:
        """Figures of codes the interface picked over a set: ``codes_used``,
        ``code_perplexity`` (of their histogram), ``code_tokens`` and ``codewords``."""
        del codes
        raise ValueError(f"the {self.kind!r} interface picks no codes")

    @property
    def compares_encoder(self) -> bool:
        """Whether :meth:`diagnostic_targets` gives a vector to compare the encoder with (an
        interface that overrides it)."""
        return type(self).diagnostic_targets is not SemanticInterface.diagnostic_targets

    def diagnostic_targets(
        self, hidden_ND: torch.Tensor, pre_norm_ND: torch.Tensor, tokens_N: torch.Tensor
    ) -> EncoderTargets:
        """The encoder's outputs at ``tokens`` (after and before its final norm) beside what
        the interface pulls them toward."""
        del hidden_ND, pre_norm_ND, tokens_N
        raise ValueError(f"the {self.kind!r} interface has no vector to compare the encoder with")

    def reading_codes(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> torch.Tensor:
        """The noise-free codes the decoder stage's own reading of a sentence picks for its
        tokens [N] (VQ-SemFace: the feature extractor's, through the codebook)."""
        del tokens_BT, mask_BT, langs_B
        raise ValueError(f"the {self.kind!r} interface picks no codes")

    def code_log_probs(self, features_ND: torch.Tensor) -> torch.Tensor:
        """log p(code | features) [N, K] over every code, without noise."""
        del features_ND
        raise ValueError(f"the {self.kind!r} interface picks no codes")

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


@torch.no_grad()
def start_embeddings_from_table(encoder: TransformerEncoder, table_VD: torch.Tensor) -> None:
    """The encoder's input token embeddings become the cross-lingual table's rows at unit
    norm, the scale of their own initialisation (the padding row stays zero): a word and its
    translation then start with near embeddings, and, the MLM output layer being tied to
    them, near predictions."""
    weight = encoder.embed.tokens.weight
    rows = table_VD.detach() * table_VD.shape[1] ** -0.5
    keep = weight[encoder.embed.tokens.padding_idx].clone()
    weight.copy_(rows.to(weight.dtype))
    weight[encoder.embed.tokens.padding_idx] = keep
