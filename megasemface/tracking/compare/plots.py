"""Plots of runs: metric curves against the step, and bars per system and direction.

Part of :mod:`megasemface.tracking.compare`, which re-exports the public names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megasemface.tracking.compare.runs import (
    CompareError,
    MetricAgg,
    RunRecord,
    metric_history,
    metric_value,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SYSTEM_ORDER", "plot_bars", "plot_curves"]

# The paper's comparison, in its order; other systems follow in the order first seen.
SYSTEM_ORDER: tuple[str, ...] = ("Transformer", "XLM", "mBART", "CL-SemFace", "VQ-SemFace")


def _figure(width: float = 8.0, height: float = 5.0) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise CompareError("plots need matplotlib: pip install matplotlib") from exc
    # A bare Figure renders through the Agg canvas on savefig: no pyplot state, no display.
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _labels(records: Sequence[RunRecord]) -> list[str]:
    """Run names, with a short run id added where names repeat."""
    counts: dict[str, int] = {}
    for record in records:
        counts[record.name] = counts.get(record.name, 0) + 1
    return [r.name if counts[r.name] == 1 else f"{r.name} ({r.run_id[:8]})" for r in records]


def _no_metric(records: Sequence[RunRecord], metric: str) -> CompareError:
    logged = sorted({k for r in records for k in r.metrics if not k.startswith("system/")})
    return CompareError(
        f"none of the {len(records)} runs logged metric {metric!r}; they logged: "
        f"{', '.join(logged) or 'no metrics'}"
    )


def plot_curves(
    records: Sequence[RunRecord],
    path: str | os.PathLike[str],
    *,
    metric: str = "loss",
    title: str | None = None,
    log_y: bool = False,
) -> Path:
    """Write a PNG with one curve per run of ``metric`` against the training step.

    Runs that never logged the metric are left out; if none did, :class:`CompareError`.
    """
    with_metric = [r for r in records if metric in r.metrics]
    if not with_metric:
        raise _no_metric(records, metric)
    from matplotlib.ticker import MaxNLocator

    fig = _figure()
    ax = fig.add_subplot()
    for record, label in zip(with_metric, _labels(with_metric), strict=True):
        points = metric_history(record, metric)
        steps, values = [p[0] for p in points], [p[1] for p in points]
        ax.plot(steps, values, label=label, marker="o" if len(points) < 2 else None)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(metric)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title or f"{metric} per step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_bars(
    records: Sequence[RunRecord],
    path: str | os.PathLike[str],
    *,
    metric: str = "test_bleu",
    label_tag: str = "system",
    group_tag: str = "direction",
    metric_agg: MetricAgg = "last",
    title: str | None = None,
) -> Path:
    """Write a PNG with one bar per system (tag ``label_tag``, else the run name).

    With several directions (tag ``group_tag``) the bars are grouped by direction, one colour
    per system. Several runs of one system and direction (seeds) give their mean, with the
    range as an error bar and each run's value as a dot on the bar. Runs without the metric
    are left out.
    """
    untagged = f"(no {group_tag})"
    values: dict[tuple[str, str], list[float]] = {}
    for record in records:
        value = metric_value(record, metric, metric_agg)
        if value is None or math.isnan(value):
            continue
        group = record.tags.get(group_tag) or untagged
        key = (group, record.tags.get(label_tag) or record.name)
        values.setdefault(key, []).append(value)
    if not values:
        raise _no_metric(records, metric)
    seen = list(dict.fromkeys(system for _, system in values))
    systems = [s for s in SYSTEM_ORDER if s in seen] + [s for s in seen if s not in SYSTEM_ORDER]
    groups = sorted({group for group, _ in values})
    width = 0.8 / len(systems) if len(groups) > 1 else 0.6
    fig = _figure(max(6.0, 1.2 * len(systems) * len(groups) + 2.0), 5.0)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(systems))]
    for i, system in enumerate(systems):
        xs, means, low, high = [], [], [], []
        dots: list[tuple[float, float]] = []
        for g, group in enumerate(groups):
            found = values.get((group, system))
            if not found:
                continue
            mean = sum(found) / len(found)
            x = g + (i - (len(systems) - 1) / 2) * width if len(groups) > 1 else i
            xs.append(x)
            means.append(mean)
            low.append(mean - min(found))
            high.append(max(found) - mean)
            if len(found) > 1:  # each run (seed) as a dot: the spread the mean hides
                dots += [(x, value) for value in found]
        spread = [low, high] if any(low) or any(high) else None
        bars = ax.bar(xs, means, width, label=system, color=colors[i], yerr=spread, capsize=3)
        ax.bar_label(bars, fmt="%.1f", fontsize="small")
        if dots:
            ax.scatter([x for x, _ in dots], [v for _, v in dots], s=12, c="black", zorder=3)
    if len(groups) > 1:
        ax.set_xticks(range(len(groups)), groups)
        ax.legend(fontsize="small")
    else:
        ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel(metric if metric_agg == "last" else f"{metric} ({metric_agg})")
    only = f" ({groups[0]})" if len(groups) == 1 and groups[0] != untagged else ""
    ax.set_title(title or f"{metric} by system{only}")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)  # fixed size whatever the user's matplotlibrc
    return out
