"""The VQ layer's passes over a chunk's logits, fused on a CPU by ``torch.compile``.

Eagerly each chunk of :class:`~megasemface.interfaces.vq.flat.FlatQuantize` makes about
twenty passes through [chunk, Kl] buffers (the functions of
:mod:`~megasemface.interfaces.vq.flat_passes`). Inductor's C++ backend fuses each of those
functions into one or two loops over the chunk (the noise hashed and added in one pass,
forward's exponentials and sums in one, backward's dot products in one and the gradient,
with its transpose for the weight's product, in one). At the paper's 102,400 codes those
passes, not the products, were most of the layer's time beyond its products' share, and
fusing them cuts the memory traffic they are bound by (docs/results.md). Compiled and eager
runs compute the same operations, up to the order of the sums and the logarithms' last bit.

Compiled where a chunk holds at least :data:`MIN_COMPILED_ELEMENTS` logits on a CPU and
``VQConfig.fused_kernels`` is on (on a GPU the Triton kernels of
:mod:`~megasemface.interfaces.vq.flat_fused` serve). Compiling takes seconds once per
process (less from inductor's on-disk cache), which such chunks pay back within a few
hundred steps; the tiny and small presets' 512 codes stay eager. Where compiling fails (no
C++ compiler), a warning says so once and the eager passes serve. Installed as the
process's passes by :mod:`megasemface.nn.cpu_speed`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["MIN_COMPILED_ELEMENTS", "run", "use_compiled"]

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
