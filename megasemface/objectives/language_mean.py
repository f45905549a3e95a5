"""A shift of the encoder's outputs by language, as a loss.

An encoder that knows each sentence's language (its language embedding, its pieces) can
carry it in one vector added to every output of that language. The SemFace decoder stage
reads one language's memory at a time, so after connection the shift of the other language
is noise to it: CL-SemFace's decoder read the encoder's output for a translation worse than
nothing (docs/results.md). This term pulls each language's mean output to zero, over the
batch's tokens of that language, in the space of the final LayerNorm before its gain and
bias: there every output has the same norm, sqrt(d), and the norm's bias, one vector for
every language, is left out of the comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["language_mean_loss"]


def language_mean_loss(
    pre_norm_BTD: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor, num_langs: int
) -> torch.Tensor:
    """The squared norm of each language's mean normalised output, averaged over the
    languages of the batch; ``pre_norm`` is the last activation before the final norm.
    Summed through a one-hot of the languages rather than a loop over the ones present,
    which would wait for the device every step."""
    normed_BTD = F.layer_norm(pre_norm_BTD.float(), pre_norm_BTD.shape[-1:])
    weights_BT = mask_BT.to(normed_BTD.dtype)
    onehot_BL = F.one_hot(langs_B, num_langs).to(normed_BTD.dtype)
    sums_LD = onehot_BL.t() @ (weights_BT[..., None] * normed_BTD).sum(dim=1)
    tokens_L = onehot_BL.t() @ weights_BT.sum(dim=1)
    present_L = (tokens_L > 0).to(normed_BTD.dtype)
    means_LD = sums_LD / tokens_L.clamp_min(1.0)[:, None]
    return (means_LD.pow(2).sum(dim=-1) * present_L).sum() / present_L.sum().clamp_min(1.0)
