"""The flat layer's passes over a chunk's [tokens, codes] logits besides its matrix products,
as functions that run eagerly or, on a CPU, fused by ``torch.compile``.

Eagerly each chunk of :class:`~megasemface.interfaces.vq.flat.FlatQuantize` makes about
twenty passes through [chunk, Kl] buffers: the Gumbel noise's int64 hashing and two
logarithms, the scores, three exponentials and their row sums in forward; normalising, two
dot products per token and the logits' gradient in backward. Inductor's C++ backend fuses
each function here into one or two loops over the chunk (the noise hashed and added in one
pass, forward's exponentials and sums in one, backward's dot products in one and the
gradient, with its transpose for the weight's product, in one). At the paper's 102,400 codes
those passes, not the products, were most of the layer's time beyond its products' share,
and fusing them cuts the memory traffic they are bound by (docs/results.md). The functions
are the eager passes themselves: compiled and eager runs compute the same operations, up to
the order of the sums and the logarithms' last bit.

Compiled where a chunk holds at least :data:`MIN_COMPILED_ELEMENTS` logits on a CPU and
``VQConfig.fused_kernels`` is on (on a GPU the Triton kernels of
:mod:`~megasemface.interfaces.vq.flat_fused` serve). Compiling takes seconds once per
process (less from inductor's on-disk cache), which such chunks pay back within a few
hundred steps; the tiny and small presets' 512 codes stay eager. Where compiling fails (no
C++ compiler), a warning says so once and the eager passes serve.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from megasemface.interfaces.vq.randomness import gumbel_of_hashes

__all__ = [
    "MIN_COMPILED_ELEMENTS",
    "exponentials",
    "gradient_dots",
    "logits_gradient",
    "noisy_scores",
    "run",
    "use_compiled",
]

MIN_COMPILED_ELEMENTS = 1 << 22
"""Logits in a chunk (tokens x local codes) from which its passes are compiled: 4M, 16 MB
of fp32 (the paper's 102,400 codes from 41 tokens)."""

_compiled: dict[str, Callable[..., Any]] = {}
_failed: list[str] = []
"""Why compiling failed in this process, once it did."""
_built: set[str] = set()
"""The functions whose compiled graph has run in this process: a later error is raised."""


def use_compiled(elements: int, device: torch.device) -> bool:
    """Whether a chunk of ``elements`` logits on ``device`` runs the compiled passes."""
    return device.type == "cpu" and elements >= MIN_COMPILED_ELEMENTS and not _failed


def run(fn: Callable[..., Any], compiled: bool, *args: Any) -> Any:
    """``fn(*args)``, through ``torch.compile`` when ``compiled`` (one graph per function,
    dynamic in the tokens and codes; built on its first call). Where it does not build, says
    so once and runs ``fn`` itself from then on."""
    if not compiled or _failed or _get_current_dispatch_mode() is not None:
        # Under a dispatch mode (FLOP counting) dynamo would not compile the function, and
        # it would skip the function's code from then on: eagerly, this once.
        return fn(*args)
    name = fn.__name__
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    try:
        result = _compiled[name](*args)
    except Exception as exc:  # a failure to build leaves the eager passes, once
        if name in _built:
            raise
        _failed.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
        warnings.warn(
            f"the VQ layer's compiled passes did not build ({_failed[0]}); running them "
            "eagerly (--model vq.fused_kernels=false does so without trying)",
            stacklevel=2,
        )
        return fn(*args)
    _built.add(name)
    return result


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
