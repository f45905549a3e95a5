"""The VQ layer's distribution over all its codes, for the interface diagnostics."""

from __future__ import annotations

from torch import Tensor

from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer

__all__ = ["code_log_probs"]

_TIE = 1e-4
"""Log-probability gap below which two codes count as tied (see :func:`code_log_probs`)."""


def code_log_probs(quantizer: GumbelVectorQuantizer, h_ND: Tensor) -> Tensor:
    """log p(code | h) [N, K] over all K codes: Eq. 5 without the Gumbel noise, at tau = 1.

    The logits are the layer's own (:meth:`GumbelVectorQuantizer.code_logits`). For the product
    layout a combination's log-probability is the sum of its groups' log-softmaxes, indexed
    like the layer's code ids (``sum_g idx_g V**(G-g-1)``). One token's ranking of the codes
    does not depend on the temperature; only averages over tokens do.

    Raises:
        RuntimeError: the argmax disagrees with the layer's own noise-free choice
            (``forward(h, sample=False).codes``) beyond float ties.
    """
    vq = quantizer.config
    logits = quantizer.code_logits(h_ND)
    if vq.layout == "flat":
        log_probs = logits.log_softmax(dim=-1)
    else:
        groups = logits.view(-1, vq.groups, vq.entries).log_softmax(dim=-1)
        log_probs = groups[:, 0]
        for g in range(1, vq.groups):
            log_probs = (log_probs[:, :, None] + groups[:, g, None, :]).flatten(1)
    chosen = quantizer(h_ND, sample=False).codes
    mine = log_probs.argmax(dim=-1)
    gap = log_probs.max(dim=-1).values - log_probs.gather(1, chosen[:, None])[:, 0]
    if bool(((mine != chosen) & (gap > _TIE)).any()):
        raise RuntimeError(
            "code_log_probs disagrees with the VQ layer's own argmax: code_logits no longer "
            "computes the logits the layer's forward uses"
        )
    return log_probs
