"""The flat layer's passes over a chunk's [tokens, codes] logits besides its matrix products.

Each function is one step of :class:`~megasemface.interfaces.vq.flat.FlatQuantize`'s chunk
loop, written as the eager passes that any device runs. The layer calls them through
:func:`megasemface.nn.kernels.run_pass`, which a process may have set to fuse each into one
or two loops (on a CPU, :mod:`megasemface.nn.cpu_passes`); the functions are the same
operations either way, up to the order of the sums and the logarithms' last bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasemface.interfaces.vq.randomness import gumbel_of_hashes

__all__ = ["exponentials", "gradient_dots", "logits_gradient", "noisy_scores"]


def noisy_scores(logits: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The selection scores ``s = l + v`` of logits [n, Kl] and the Gumbel noise of the
    row seeds [n] and scaled code indices [Kl] (``randomness.noise_hashes``), in one pass
    when compiled. Eagerly, ``randomness.gumbel_noise`` hashes the same values in
    cache-sized blocks instead of [n, Kl] int64 temporaries."""
    return logits + gumbel_of_hashes(rows[:, None] + cols[None, :])


def exponentials(
    scores: Tensor, logits: Tensor, maxes: Tensor, tau: float, sample: bool, need_soft: bool
) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """From a chunk's scores and logits [n, Kl] and the global maxima [n, 2] of each: the
    unnormalised Gumbel softmax ``exp((s - max s) / tau)`` (when ``need_soft``), the centred
    logits ``l - max l``, their exponentials, and the row sums [n, 3] of the first, the
    third, and the product of the second and third (zero where there is no first). The
    centred logits overwrite ``logits``, and when sampling the softmax overwrites ``scores``
    (otherwise the logits themselves)."""
    soft = None
    if need_soft:
        y = scores.div_(tau) if sample else scores / tau
        soft = y.sub_((maxes[:, 0] / tau)[:, None]).exp_()
    centered = logits.sub_(maxes[:, 1:])
    plain = centered.exp()
    first = soft.sum(dim=1) if soft is not None else torch.zeros_like(plain[:, 0])
    sums = torch.stack([first, plain.sum(dim=1), (plain * centered).sum(dim=1)], dim=1)
    return soft, centered, plain, sums


def gradient_dots(
    soft: Tensor | None,
    plain: Tensor | None,
    stats: Tensor,
    grad_soft: Tensor | None,
    grad_div: Tensor | None,
    from_gumbel: bool,
) -> tuple[Tensor, Tensor | None]:
    """This rank's parts [n, 2] of ``<q, gq>`` and ``<r, grad_div>`` (see
    ``flat._flat_logit_backward``), and ``gq``: the straight-through product
    ``grad_soft`` (zeros where None) plus, when the diversity averages Eq. 5's
    probabilities, ``grad_div``. In place, as the buffers are not read again: ``soft`` (q)
    and ``plain`` (r) are normalised by the partition sums in ``stats`` [n, 5], and ``gq``
    is ``grad_soft`` itself. (Eagerly that is one pass fewer each, a visible share of a
    call at the tiny preset; compiled, the in-place writes cost little either way.)"""
    dots = torch.zeros(stats.shape[0], 2, dtype=torch.float32, device=stats.device)
    if soft is not None:
        soft.div_(stats[:, 2:3])
        if grad_soft is None:
            grad_soft = torch.zeros_like(soft)
        if from_gumbel and grad_div is not None:
            grad_soft.add_(grad_div)
        dots[:, 0] = (soft * grad_soft).sum(dim=1)
    if plain is not None:
        plain.div_(stats[:, 3:4])
        if not from_gumbel and grad_div is not None:
            dots[:, 1] = plain @ grad_div
    return dots, grad_soft


def logits_gradient(
    soft: Tensor | None,
    plain: Tensor | None,
    centered: Tensor | None,
    stats: Tensor,
    grad_soft: Tensor | None,
    grad_div: Tensor | None,
    dots: Tensor,
    grad_entropy: Tensor | None,
    tau: float,
    from_gumbel: bool,
    bias_grad: bool,
    transposed: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The logits' gradient [n, Kl] (fp32) from :func:`gradient_dots`' normalised buffers,
    ``gq`` (as ``grad_soft``) and the global ``dots``, the same [Kl, n] contiguous when
    ``transposed`` (written in the same pass when compiled), and its column sums [Kl] when
    ``bias_grad``. The buffers are overwritten."""
    if soft is not None:
        assert grad_soft is not None
        grad_logits = grad_soft.sub_(dots[:, 0:1]).mul_(soft).div_(tau)
    else:
        assert plain is not None
        grad_logits = torch.zeros_like(plain)
    if plain is not None:
        if not from_gumbel and grad_div is not None:
            grad_logits.add_((grad_div - dots[:, 1:2]).mul_(plain))
        if grad_entropy is not None:
            assert centered is not None
            # A 0-dim tensor multiplies without a host synchronisation.
            grad_logits.sub_(plain.mul_(centered.sub_(stats[:, 4:5])).mul_(grad_entropy))
    return (
        grad_logits,
        grad_logits.t().contiguous() if transposed else None,
        grad_logits.sum(dim=0) if bias_grad else None,
    )
