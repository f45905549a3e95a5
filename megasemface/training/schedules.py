"""Schedules as pure functions of the step, so that a resumed run repeats them exactly."""

from __future__ import annotations

import itertools
import math

__all__ = ["inverse_sqrt_lr", "parse_schedule", "schedule_value"]


def inverse_sqrt_lr(base_lr: float, warmup_steps: int, step: int) -> float:
    """Linear warm-up to ``base_lr``, then decay with 1/sqrt(step): the paper's fine-tuning
    schedule."""
    return base_lr * min(step / warmup_steps, math.sqrt(warmup_steps / step))


def parse_schedule(text: str) -> list[tuple[int, float]]:
    """``"0:1,100000:0.1,300000:0"`` -> [(0, 1.0), (100000, 0.1), (300000, 0.0)]."""
    points = []
    for item in text.split(","):
        step, sep, value = item.partition(":")
        try:
            points.append((int(step), float(value)))
        except ValueError:
            raise ValueError(f"schedule points are STEP:VALUE, got {item!r} in {text!r}") from None
        if not sep:
            raise ValueError(f"schedule points are STEP:VALUE, got {item!r} in {text!r}")
    if [s for s, _ in points] != sorted({s for s, _ in points}):
        raise ValueError(f"schedule steps must increase: {text!r}")
    return points


def schedule_value(points: list[tuple[int, float]], step: int) -> float:
    """Piecewise-linear interpolation; constant before the first and after the last point."""
    if step <= points[0][0]:
        return points[0][1]
    for (s0, v0), (s1, v1) in itertools.pairwise(points):
        if step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return points[-1][1]
