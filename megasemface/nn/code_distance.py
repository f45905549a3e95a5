"""Eq. 4's distances as code logits, shared by the VQ layer and the codebook bridge.

``-s ||h - z||^2`` for codes z equals ``h . W + b`` with ``W = 2 s z`` and ``b = -s ||z||^2``,
up to the per-token constant ``s ||h||^2``, which no softmax or argmax sees: one GEMM, which
the flat VQ layer chunks and splits (computing ``(2 s h) z^T`` from the table itself:
``interfaces/vq/flat.py``). The scale s is 1 / sqrt(w) for codes of width w up to
``vq.distance_width``, and sqrt(distance_width) / w beyond (``nn/config.py``).
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["distance_logit_weights", "distance_scale"]


def distance_scale(width: int, distance_width: int) -> float:
    """The factor s of the logits ``-s ||h - z||^2`` for codes of ``width``: 1 / sqrt(width)
    up to ``distance_width``, then sqrt(distance_width) / width (the two agree there)."""
    if width <= distance_width:
        return 1.0 / math.sqrt(width)
    return math.sqrt(distance_width) / width


def distance_logit_weights(codebook: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(W, b)`` for codes [..., w]: ``W = 2 s z`` in the codebook's dtype and shape,
    ``b = -s ||z||^2`` in fp32, flattened over the leading dimensions.

    ``W`` is a new tensor, not the parameter: under ZeRO-3 a parameter's storage is released
    after the forward, and the backward of ``b`` reads ``W``.
    """
    weight = codebook * (2.0 * scale)
    bias = weight.float().square().sum(dim=-1).reshape(-1) / (-4.0 * scale)
    return weight, bias
