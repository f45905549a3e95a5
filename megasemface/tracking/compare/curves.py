"""Learning curves of pre-training runs side by side: each run's encoder MLM and decoder-stage
loss at every logged step, as a Markdown table and a plot, against the uniform guess.

Part of :mod:`megasemface.tracking.compare`. A curve is read from its run's MLflow metrics
(:func:`curve_from_mlflow`), or, for a run trained without tracking, from the progress lines
its trainer printed into the run's ``launcher.log`` (:func:`curve_from_log`: the same values,
to the three decimals printed). Both keep, of a step logged twice (a run resumed from an
earlier checkpoint), the value logged last.

The uniform guess is ``ln V`` nats a token for a vocabulary of V pieces: what a model that
has learnt nothing scores, for the MLM and for the decoder's loss alike. An encoder whose MLM
stays above it reads nothing useful from its interface.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megasemface.tracking.compare.plots import _figure, _save
from megasemface.tracking.compare.runs import CompareError, metric_history, select_runs

__all__ = [
    "CURVE_METRICS",
    "Curve",
    "curve_from_log",
    "curve_from_mlflow",
    "curves_table",
    "plot_learning_curves",
]

ENCODER_METRIC = "enc_mlm"
DECODER_METRICS = ("dec_clm", "dec_mlm")
"""The decoder stage's loss: its causal LM (the paper's), or its MLM (``--decoder-objective
mlm``)."""
CURVE_METRICS = (ENCODER_METRIC, *DECODER_METRICS, "tokens_per_s")

# What the trainer prints every --log-interval steps (training/trainer.py, _Progress):
# "step 20/200 | 3,512 tok/s | loss 9.102 enc_mlm=8.930 dec_clm=7.115 | lr ... | ETA 51s".
_PROGRESS = re.compile(r"^(?:\[rank\d+\]:\s*)?step (\d+)/\d+ \| ([\d,.]+) tok/s \| (.*)$")
_VALUE = re.compile(r"(?<![\w.])([a-z][a-z0-9_]*)=(-?(?:\d+(?:\.\d*)?|nan|inf))(?![\w.])")


@dataclass(frozen=True)
class Curve:
    """One system's logged values: ``points[metric][step]``."""

    system: str
    """The name in the table and plot (the system's display name)."""
    points: dict[str, dict[int, float]] = field(default_factory=dict)
    source: str = ""
    """Where it was read: ``MLflow run <id>`` or the log's path."""

    @property
    def encoder(self) -> dict[int, float]:
        return self.points.get(ENCODER_METRIC, {})

    @property
    def decoder_metric(self) -> str | None:
        """The decoder stage's loss this run logged (None: an encoder-stage run)."""
        return next((name for name in DECODER_METRICS if self.points.get(name)), None)

    @property
    def decoder(self) -> dict[int, float]:
        name = self.decoder_metric
        return self.points[name] if name else {}

    @property
    def steps(self) -> list[int]:
        return sorted({step for values in self.points.values() for step in values})

    def tokens_per_s(self) -> float | None:
        """Median over the logged windows (None: none logged)."""
        values = list(self.points.get("tokens_per_s", {}).values())
        return statistics.median(values) if values else None


def curve_from_mlflow(tracking_uri: str, run_id: str, system: str) -> Curve:
    """The curve of MLflow run ``run_id`` in ``tracking_uri``.

    Raises:
        CompareError: the store or the run does not exist.
    """
    (record,) = select_runs(tracking_uri, run_ids=[run_id], lineage=False)
    points = {
        name: dict(metric_history(record, name))  # by step, then time: the last one stays
        for name in CURVE_METRICS
        if name in record.metrics
    }
    return Curve(system, points, f"MLflow run {run_id}")


def curve_from_log(path: str | os.PathLike[str], system: str) -> Curve:
    """The curve of the progress lines in a run's ``launcher.log``.

    Raises:
        CompareError: the log is missing or holds no progress line.
    """
    log = Path(path)
    if not log.is_file():
        raise CompareError(f"{log}: no such log; the run has not started")
    points: dict[str, dict[int, float]] = {}
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _PROGRESS.match(line.strip())
        if match is None:
            continue
        step = int(match.group(1))
        points.setdefault("tokens_per_s", {})[step] = float(match.group(2).replace(",", ""))
        for name, value in _VALUE.findall(match.group(3)):
            if name in CURVE_METRICS:
                points.setdefault(name, {})[step] = float(value)
    if not points:
        raise CompareError(f"{log} holds no progress line of a training step")
    return Curve(system, points, str(log))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def curves_table(curves: Sequence[Curve], vocab_size: int) -> str:
    """Markdown: a summary per system, then each logged step's encoder MLM and decoder-stage
    loss per system (nats a token), with the uniform guess ln V above them."""
    uniform = math.log(vocab_size)
    lines = [
        f"Uniform guess: ln {vocab_size:,} = {uniform:.2f} nats a token (a model that has "
        "learnt nothing; the MLM and the decoder's loss alike).",
        "",
        "| system | steps | encoder MLM | below uniform from step | decoder stage | "
        "tokens/s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for curve in curves:
        mlm, decoder = curve.encoder, curve.decoder
        below = next((step for step in sorted(mlm) if mlm[step] < uniform), None)
        last_decoder = f"{curve.decoder_metric} {decoder[max(decoder)]:.2f}" if decoder else "-"
        speed = curve.tokens_per_s()
        lines.append(
            f"| {curve.system} | {max(curve.steps)} | {_number(mlm[max(mlm)] if mlm else None)} "
            f"| {'-' if below is None else below} | {last_decoder} | "
            f"{'-' if speed is None else f'{speed:,.0f}'} |"
        )
    columns: list[tuple[str, dict[int, float]]] = []
    for curve in curves:
        columns.append((f"{curve.system}: MLM", curve.encoder))
        if curve.decoder_metric:
            columns.append((f"{curve.system}: {curve.decoder_metric}", curve.decoder))
    steps = sorted({step for _, values in columns for step in values})
    lines += [
        "",
        "| step | " + " | ".join(name for name, _ in columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for step in steps:
        cells = [_number(values.get(step)) for _, values in columns]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_learning_curves(
    curves: Sequence[Curve],
    path: str | os.PathLike[str],
    vocab_size: int,
    title: str = "",
) -> Path:
    """A PNG: the encoder MLM of every system and, beside it, the decoder-stage loss of those
    that have one, each panel with the uniform guess ln V as a dashed line."""
    from matplotlib.ticker import MaxNLocator

    uniform = math.log(vocab_size)
    panels = [("encoder stage: MLM", [(c.system, c.encoder) for c in curves if c.encoder])]
    decoders = [(c.system, c.decoder) for c in curves if c.decoder]
    if decoders:
        panels.append(("decoder stage: loss", decoders))
    fig = _figure(6.0 * len(panels), 4.5)
    colors = {curve.system: f"C{i % 10}" for i, curve in enumerate(curves)}
    for index, (name, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), index + 1)
        for system, values in series:
            steps = sorted(values)
            ax.plot(
                steps,
                [values[s] for s in steps],
                label=system,
                color=colors[system],
                marker="o" if len(steps) < 12 else None,
            )
        ax.axhline(
            uniform, color="grey", linestyle="--", label=f"uniform guess ln V = {uniform:.2f}"
        )
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("nats a token")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)
