"""VQ-SemFace's own options of train.py: its loss terms' weights and its codebook's health
warning (its codebook's shape is the model's, ``--model vq.*``). Torch-free: parsing options
reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["CODEBOOK_INITS", "RANDOM_CODES", "TABLE_CODES", "VQOptions"]

RANDOM_CODES = "random"
"""The codebook's codes start as N(0, 1) draws from the run's seed."""
TABLE_CODES = "table"
"""The codebook's codes start as centroids of the cross-lingual table's rows
(interfaces/vq/table_codes.py)."""
CODEBOOK_INITS = (RANDOM_CODES, TABLE_CODES)


@dataclasses.dataclass(kw_only=True)
class VQOptions:
    """The options of the ``vq`` interface."""

    diversity_weight: float = 2.0
    """VQ: weight of the diversity loss (the paper's losses: 1)."""
    l2_weight: float = 1.0
    """VQ: weight of the L2 penalty on the encoder's last activations."""
    commitment_weight: float = 0.0
    """VQ: weight of the commitment term (encoder output to its argmax code); 0: off."""
    # The diversity loss asks the batch's average code distribution to be uniform, which
    # per-token distributions spread over many codes satisfy too, and the argmax then falls
    # on a few codes; with the token entropy the two maximise the mutual information of
    # tokens and codes.
    token_entropy_weight: float = 0.5
    """VQ: weight of the mean per-token entropy of the code distribution (not in the paper;
    on by default, measured better on validation); 0: off."""
    vq_codebook_init: str = RANDOM_CODES
    """VQ-SemFace: how the flat codebook's codes start. random: N(0, 1) from the seed; table:
    k-means centroids of the --cl-table rows of the pieces the shards hold, at the same norm,
    so that a word and its translation start near one code (the paper's Fig. 5); the
    encoder and joint stages; with --cl-table-input the encoder's input embeddings start from
    the table too (interfaces/vq/table_codes.py, docs/pretraining.md)."""
    codebook_warn_fraction: float = 0.25
    """VQ-SemFace: warn that the codebook collapses when the argmax picks fewer codes over a
    logging window than this share of what a uniform choice would pick for its n tokens,
    K(1-(1-1/K)^n), and the code histogram's perplexity is under a tenth of min(K, n)."""

    def loss_weights(self) -> dict[str, float]:
        """The weights of the loss terms the VQ layer gives, by their names."""
        return {
            "diversity": self.diversity_weight,
            "l2": self.l2_weight,
            "commitment": self.commitment_weight,
            "token_entropy": self.token_entropy_weight,
        }

    @staticmethod
    def add_arguments(add: Callable[..., None]) -> None:
        """Adds the section's flags with ``add`` (``OptionSection``)."""
        defaults = VQOptions()
        for name in ("diversity_weight", "l2_weight", "commitment_weight", "token_entropy_weight"):
            add(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
        add("--vq-codebook-init", default=defaults.vq_codebook_init, choices=CODEBOOK_INITS)
        add("--codebook-warn-fraction", type=float, default=defaults.codebook_warn_fraction)
