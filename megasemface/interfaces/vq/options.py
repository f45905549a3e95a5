"""VQ-SemFace's own options of train.py. Torch-free: parsing options reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["VQOptions"]


@dataclasses.dataclass(kw_only=True)
class VQOptions:
    """The options of the ``vq`` interface (its loss weights are the pre-training losses',
    ``PretrainingOptions``; its codebook's shape is the model's, ``--model vq.*``)."""

    codebook_warn_fraction: float = 0.25
    """VQ-SemFace: warn that the codebook collapses when the argmax picks fewer codes over a
    logging window than this share of what a uniform choice would pick for its n tokens,
    K(1-(1-1/K)^n), and the code histogram's perplexity is under a tenth of min(K, n)."""

    @staticmethod
    def add_arguments(add: Callable[..., None]) -> None:
        """Adds the section's flags with ``add`` (``OptionSection``)."""
        add("--codebook-warn-fraction", type=float, default=VQOptions.codebook_warn_fraction)
