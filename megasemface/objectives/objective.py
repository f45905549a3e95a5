"""What configures the pre-training objectives, and what a model's loss returns."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from megasemface.interfaces.registry import DECODER_CODES
from megasemface.nn.config import ModelConfig
from megasemface.objectives.sequences import SpecialTokens

__all__ = [
    "MSE_FULL_WIDTH",
    "ObjectiveConfig",
    "StageOutput",
    "check_languages",
    "default_mse_weight",
]


@dataclasses.dataclass(kw_only=True)
class ObjectiveConfig:
    """Pre-training objectives and loss weights."""

    mlm_prob: float = 0.15
    """Share of tokens predicted by MLM (80% masked, 10% random, 10% kept)."""
    decoder_objective: Literal["clm", "mlm"] = "clm"
    """Decoder stage loss: causal LM (Eq. 3) or masked LM over a bidirectional decoder (Eq. 2)."""
    decoder_noise: bool = True
    """Feed the interface a noised copy C(x) (word drop, local shuffle) in the decoder stage."""
    word_drop: float = 0.1
    shuffle_window: int = 3
    mse_weight: float | None = None
    """CL-SemFace: weight of the MSE term of Eq. 1 (0 for the 'without MSE' ablation);
    None: :func:`default_mse_weight` of the model's width."""
    diversity_weight: float = 2.0
    """VQ-SemFace: weight of the diversity loss (docs/reproduce.md measures 1 and 2)."""
    l2_weight: float = 1.0
    """VQ-SemFace: weight of the L2 penalty on the encoder's last activations."""
    commitment_weight: float = 0.0
    """VQ-SemFace, not in the paper: weight of a VQ-VAE-style commitment term pulling the
    encoder's output towards its argmax code, which is what the decoder stage was trained
    on and what it reads once the stages are connected. 0: the paper's losses only."""
    token_entropy_weight: float = 0.5
    """VQ-SemFace, not in the paper: weight of the mean entropy of each token's code
    distribution. The diversity loss asks the batch's average distribution to be uniform,
    which per-token distributions spread over many codes satisfy too; then the argmax falls
    on a few codes. Together the two maximise the mutual information between tokens and
    codes. On by default because it measured better on validation (docs/reproduce.md, the
    VQ codebook); 0 with diversity weight 1: the paper's losses only."""
    extractor_diversity: bool = False
    """VQ-SemFace, not in the paper: the decoder stage's feature extractor is trained with
    the diversity and token-entropy terms too (the encoder's weights), on the codes it picks
    from the fixed codebook. Without them only the decoder's loss trains it, and it picks a
    small part of the codebook, so the decoder's cross-attention is pre-trained on few of
    the codes the encoder uses."""
    decoder_codes: Literal["extractor", "encoder", "encoder-trained"] = "extractor"
    """VQ-SemFace: what picks the codes the decoder stage reads (train.py's default is
    ``encoder-trained`` for the joint stage, ``extractor`` for the separate stages, where it
    is the only choice). ``extractor``: the paper's feature extractor, trained by the
    decoder's loss. ``encoder`` (not in the paper): the encoder itself, without gradient,
    through the same VQ layer, so the decoder's cross-attention is pre-trained on the codes
    the encoder emits for the sentence. Each of the two otherwise learns its own assignment
    of the fixed codebook, and they pick the same code for under 1% of the tokens
    (docs/reproduce.md, the study budget).
    ``encoder-trained`` (not in the paper): the same, and the decoder's loss trains the
    encoder too, through the straight-through gradient of its codes (the codebook stays
    the encoder loss's), so the codes carry what the decoder needs to rebuild the sentence:
    the stages are then pre-trained together, as a denoising autoencoder through the codes
    beside the MLM, not separately. CL-SemFace: ``extractor`` is the table's rows of the
    noised copy (the paper's), ``encoder`` and ``encoder-trained`` the encoder's outputs for
    it, as the connected decoder reads them, at the share ``decoder_continuous`` of the
    tokens, and the table's rows at the rest."""
    decoder_memory_norm: bool = False
    """The decoder stage reads its interface memory through the encoder's final LayerNorm,
    with the norm's weights held fixed (the decoder's loss trains only the decoder). The
    connected decoder reads the encoder's output, which comes through that norm; CL-SemFace's
    table rows of the noised copy become LN(E(C(x))), what the encoder emits for a token
    whose activation before the norm has met its Eq. 1 target."""
    decoder_continuous: float = 0.0
    """With ``decoder_codes`` ``encoder`` or ``encoder-trained``: the share of tokens at which
    the decoder stage reads the encoder's continuous output instead of the interface's
    memory of it (VQ: its code; CL: the table's row of the token), drawn per token in
    training, so that the cross-attention is pre-trained on the memory the connected model
    gives it too. 0: the interface's memory alone; 1: the output alone, in training and
    evaluation."""
    infill_ratio: float = 0.35
    """mBART baseline: share of tokens masked in Poisson spans."""
    poisson_lambda: float = 3.5
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.decoder_objective not in ("clm", "mlm"):
            raise ValueError(f"decoder_objective must be clm or mlm, got {self.decoder_objective}")
        if self.decoder_codes not in DECODER_CODES:
            raise ValueError(
                f"decoder_codes must be one of {', '.join(DECODER_CODES)}, got {self.decoder_codes}"
            )
        if not 0 <= self.decoder_continuous <= 1:
            raise ValueError(f"decoder_continuous must be in [0, 1], got {self.decoder_continuous}")
        if not 0 < self.mlm_prob < 1:
            raise ValueError(f"mlm_prob must be in (0, 1), got {self.mlm_prob}")

    def for_width(self, d_model: int) -> ObjectiveConfig:
        """This config with the width-dependent defaults resolved for ``d_model``."""
        if self.mse_weight is not None:
            return self
        return dataclasses.replace(self, mse_weight=default_mse_weight(d_model))

    def weight_of(self, loss_name: str) -> float:
        weights = {
            "mse": self.mse_weight,
            "diversity": self.diversity_weight,
            "l2": self.l2_weight,
            "commitment": self.commitment_weight,
            "token_entropy": self.token_entropy_weight,
        }
        weight = weights[loss_name]
        if weight is None:
            raise ValueError(f"{loss_name} weight unresolved: call for_width(d_model) first")
        return weight


MSE_FULL_WIDTH = 128
"""The widest model at which CL-SemFace's MSE term keeps the weight 1 by default."""


def default_mse_weight(d_model: int) -> float:
    """CL-SemFace's MSE weight by default: 1 up to d_model 128 (the demo's and the study's
    widths, where it was chosen), 0.01 wider.

    Eq. 1's squared distance is summed over the dimensions, so it grows with the width while
    the MLM does not: at d 1,024 it is about 1,300 nats a token against the MLM's 9, and
    with weight 1 the encoder's validation MLM stayed above the uniform guess after 100
    steps (10.4 against 8.99; 8.7 with 0.01, 7.8 with 1/1,024, 7.5 without the term; XLM
    6.9). docs/reproduce.md, "The encoders at the paper's scale".
    """
    return 1.0 if d_model <= MSE_FULL_WIDTH else 0.01


@dataclasses.dataclass
class StageOutput:
    """A loss to back-propagate, its detached components and metrics.

    Components and tensor metrics stay on the device until a logging step reads them, so a
    step waits for the device only where its control flow needs a value."""

    loss: torch.Tensor
    components: dict[str, torch.Tensor]
    metrics: dict[str, float | torch.Tensor]
    num_targets: int

    def __add__(self, other: StageOutput) -> StageOutput:
        return StageOutput(
            self.loss + other.loss,
            {**self.components, **other.components},
            {**self.metrics, **other.metrics},
            self.num_targets + other.num_targets,
        )


def check_languages(config: ModelConfig, special: SpecialTokens) -> None:
    """The model has one language embedding per language tag of the tokenizer."""
    if len(special.lang_tags) != config.num_langs:
        raise ValueError(
            f"the tokenizer has {len(special.lang_tags)} languages, the model config "
            f"{config.num_langs}"
        )
