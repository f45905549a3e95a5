"""The terms model FLOPs are counted in (``training/model_flops.py``), shared with the
layers that count their own (an interface's): a matrix product and what its backward adds.
Torch-free: the options' checks count a step's FLOPs too."""

from __future__ import annotations

from typing import Literal

__all__ = ["BACKWARD_FACTOR", "Backward", "linear"]

Backward = Literal["train", "input", "off"]
"""``train``: weights and inputs get gradients; ``input``: the inputs only (frozen or
detached weights); ``off``: no backward."""

BACKWARD_FACTOR: dict[str, float] = {"train": 3.0, "input": 2.0, "off": 1.0}
"""A product's forward and backward FLOPs over its forward's, by :data:`Backward`."""


def linear(rows: float, d_in: int, d_out: int) -> float:
    """A product of ``rows`` inputs of width ``d_in`` with a [d_in, d_out] weight."""
    return 2.0 * rows * d_in * d_out
