"""The matrix products and chunk passes that the objectives and the VQ layer call by name.

The model path multiplies through :func:`mm` and :func:`linear` and runs the VQ layer's
passes over its logits through :func:`run_pass`; by default these are torch's own operators
and the passes run as written, on any device. A process may install other
:class:`Kernels` (:func:`install`) that compute the same products and passes faster on its
hardware: the model path then takes them without naming them, and a reader of the model
path reads torch's operators. :func:`takes` tells the few callers whose fallback arranges
its work differently (a bias added after the product rather than in it) whether the
installed products take a tensor; those callers keep torch's arrangement wherever it does
not, so that the numbers are the ones torch's own products give.

Installed by :mod:`megasemface.nn.cpu_speed`, which says when and why.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "Kernels",
    "compiled_passes",
    "install",
    "installed",
    "linear",
    "mm",
    "run_pass",
    "takes",
]


def _never(*_args: Any) -> bool:
    return False


def _eagerly(fn: Callable[..., Any], _compiled: bool, *args: Any) -> Any:
    return fn(*args)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What the model path's products and passes run through (torch's own by default)."""

    takes: Callable[[torch.Tensor], bool] = _never
    """Whether :attr:`mm` and :attr:`linear` take products of tensors like this one through
    kernels of their own (rather than falling back to torch's)."""
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = operator.matmul
    """``a @ b`` for 2-D tensors, outside autograd."""
    linear: Callable[..., torch.Tensor] = F.linear
    """``F.linear(x, weight, bias)``."""
    compiled_passes: Callable[[int, torch.device], bool] = _never
    """Whether a chunk of this many logits on this device runs its passes compiled."""
    run_pass: Callable[..., Any] = _eagerly
    """``run_pass(fn, compiled, *args)``: ``fn(*args)``, compiled where ``compiled`` says."""


_installed = Kernels()


def install(kernels: Kernels) -> Kernels:
    """Makes ``kernels`` the process's products and passes; returns the ones they replace."""
    global _installed
    before, _installed = _installed, kernels
    return before


def installed() -> Kernels:
    """The process's products and passes."""
    return _installed


def takes(t: torch.Tensor) -> bool:
    """Whether the installed products take ``t``'s products through kernels of their own."""
    return _installed.takes(t)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D tensors (no autograd), through the installed products."""
    return _installed.mm(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the installed products."""
    return _installed.linear(x, weight, bias)


def compiled_passes(elements: int, device: torch.device) -> bool:
    """Whether a chunk of ``elements`` logits on ``device`` runs its passes compiled."""
    return _installed.compiled_passes(elements, device)


def run_pass(fn: Callable[..., Any], compiled: bool, *args: Any) -> Any:
    """``fn(*args)``; compiled where ``compiled`` and the installed passes compile."""
    return _installed.run_pass(fn, compiled, *args)
