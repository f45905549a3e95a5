"""What configures the pre-training objectives, and what a model's loss returns."""

from __future__ import annotations

import dataclasses

import torch

from megasemface.interfaces.registry import DECODER_CODES, interface_option_sections
from megasemface.nn.config import ModelConfig
from megasemface.objectives.options import DECODER_OBJECTIVES, PretrainingOptions
from megasemface.objectives.sequences import SpecialTokens

__all__ = [
    "MSE_FULL_WIDTH",
    "ObjectiveConfig",
    "StageOutput",
    "check_languages",
    "default_interface_weights",
    "default_mse_weight",
]


def default_interface_weights() -> dict[str, float]:
    """Every registered interface's loss weights at their defaults."""
    weights: dict[str, float] = {}
    for section in interface_option_sections():
        weights |= section().loss_weights()
    return weights


@dataclasses.dataclass(kw_only=True)
class ObjectiveConfig(PretrainingOptions):
    """Pre-training objectives: the run's options (:class:`PretrainingOptions`, where a
    None the run's stage did not fill in reads as the choice every stage accepts: the
    extractor's codes, no memory norm, no continuous output) and the objectives' fixed
    shapes."""

    mlm_prob: float = 0.15
    """Share of tokens predicted by MLM (80% masked, 10% random, 10% kept)."""
    decoder_noise: bool = True
    """Feed the interface a noised copy C(x) (word drop, local shuffle) in the decoder stage."""
    shuffle_window: int = 3
    infill_ratio: float = 0.35
    """mBART baseline: share of tokens masked in Poisson spans."""
    poisson_lambda: float = 3.5
    interface_weights: dict[str, float] = dataclasses.field(
        default_factory=default_interface_weights
    )
    """The weights of the interface's own loss terms, by name (its options section's
    ``loss_weights``); by default every registered interface's defaults."""

    def __post_init__(self) -> None:
        if self.decoder_codes is None:
            self.decoder_codes = "extractor"
        self.decoder_memory_norm = bool(self.decoder_memory_norm)
        self.decoder_continuous = self.decoder_continuous or 0.0
        self.language_mean_weight = self.language_mean_weight or 0.0
        if self.language_mean_weight < 0:
            raise ValueError(f"language_mean_weight must be >= 0, got {self.language_mean_weight}")
        if self.decoder_objective not in DECODER_OBJECTIVES:
            raise ValueError(
                f"decoder_objective must be one of {', '.join(DECODER_OBJECTIVES)}, got "
                f"{self.decoder_objective}"
            )
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
        """The weight of the loss term ``loss_name`` an interface's encoder head gives."""
        weights = {"mse": self.mse_weight, **self.interface_weights}
        if loss_name not in weights:
            raise ValueError(f"no weight for the loss term {loss_name!r}; known: {sorted(weights)}")
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
    the MLM does not, and at the paper's width weight 1 keeps the encoder's MLM from
    learning; docs/reproduce.md, "The encoders at the paper's scale", has the runs the
    weight was chosen on.
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
