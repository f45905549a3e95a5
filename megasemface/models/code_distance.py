"""Eq. 4's distances as code logits, shared by the VQ layer and the codebook bridge.

``-||h - z||^2 / sqrt(w)`` for codes z of width w equals ``h . W - b`` with ``W = 2 z /
sqrt(w)`` and ``b = ||z||^2 / sqrt(w)``, up to the per-token constant ``||h||^2 / sqrt(w)``,
which no softmax or argmax sees: one GEMM, which the flat VQ layer chunks and splits.
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["distance_logit_weights"]


def distance_logit_weights(codebook: Tensor) -> tuple[Tensor, Tensor]:
    """``(W, b)`` for codes [..., w]: ``W = 2 z / sqrt(w)`` in the codebook's dtype and shape,
    ``b = -||z||^2 / sqrt(w)`` in fp32, flattened over the leading dimensions.

    ``W`` is a new tensor, not the parameter: under ZeRO-3 a parameter's storage is released
    after the forward, and the backward of ``b`` reads ``W``.
    """
    scale = 1.0 / math.sqrt(codebook.shape[-1])
    weight = codebook * (2.0 * scale)
    bias = weight.float().square().sum(dim=-1).reshape(-1) / (-4.0 * scale)
    return weight, bias
