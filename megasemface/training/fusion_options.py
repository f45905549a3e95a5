"""Deep fusion's fine-tuning options, read without torch (parsing options reads them)."""

from __future__ import annotations

__all__ = ["FUSION_LOSSES", "parse_fusion_weights"]

FUSION_LOSSES = ("translation", "words", "sentence", "mlm")
"""Eq. 18's losses, in the order ``--fusion-weights`` gives their weights."""


def parse_fusion_weights(text: str) -> dict[str, float]:
    """``T,TWP,TSP,MLM`` -> the weight of each loss, by :data:`FUSION_LOSSES`' names.

    Raises:
        ValueError: not four numbers >= 0, or all 0; the message is the command line's.
    """
    parts = text.split(",")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    if len(weights) != len(FUSION_LOSSES) or not all(w >= 0 for w in weights) or not any(weights):
        raise ValueError(
            "--fusion-weights takes four weights >= 0, not all 0, of the translation, "
            f"target-words, target-sentence and MLM losses (e.g. 1,1,1,1), got {text!r}"
        )
    return dict(zip(FUSION_LOSSES, weights, strict=True))
