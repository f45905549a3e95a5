"""Learning curves of pre-training runs side by side: each run's encoder MLM and decoder-stage
loss at every logged step and at every validation, as a Markdown table and a plot, against
the uniform guess.

Part of :mod:`megasemface.tracking.compare`. A curve is read from its run's MLflow metrics
(:func:`curve_from_mlflow`), or, for a run trained without tracking, from the progress lines
its trainer printed into the run's ``launcher.log`` (:func:`curve_from_log`: the same values,
to the three decimals printed). Both keep, of a step logged twice (a run resumed from an
earlier checkpoint), the value logged last.

The validation figures (``valid_enc_mlm``, ``valid_dec_clm``; the VQ encoder's noise-free
codeword perplexity on that text) are the ones to compare: the same sentences and masks each
time, in eval mode (training/units/pretraining_validation.py). The training figures are one
batch's at each logged step.

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
VALID_PREFIX = "valid_"
CODE_METRICS = ("valid_enc_code_perplexity", "valid_enc_code_tokens", "valid_enc_codewords")
"""The VQ encoder's noise-free codewords on the validation text: their histogram's perplexity,
the tokens counted and the codebook's codewords."""
CURVE_METRICS = (
    ENCODER_METRIC,
    *DECODER_METRICS,
    "tokens_per_s",
    *(VALID_PREFIX + name for name in (ENCODER_METRIC, *DECODER_METRICS)),
    *CODE_METRICS,
)
COLLAPSE_SHARE = 0.1
"""A codeword perplexity under this share of min(tokens, codewords) reads as collapse
(interfaces/vq/code_usage.py's floor)."""

# What the trainer prints every --log-interval steps (training/trainer.py, _Progress):
# "step 20/200 | 3,512 tok/s | loss 9.102 enc_mlm=8.930 dec_clm=7.115 | lr ... | ETA 51s".
_PROGRESS = re.compile(r"^(?:\[rank\d+\]:\s*)?step (\d+)/\d+ \| ([\d,.]+) tok/s \| (.*)$")
# And after each validation (training/units/pretraining_validation.py):
# "validation at step 20: valid_enc_mlm=8.512 valid_dec_clm=7.204".
_VALIDATION = re.compile(r"^(?:\[rank\d+\]:\s*)?validation at step (\d+): (.*)$")
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
    def valid_encoder(self) -> dict[int, float]:
        return self.points.get(VALID_PREFIX + ENCODER_METRIC, {})

    @property
    def valid_decoder(self) -> dict[int, float]:
        name = self.decoder_metric
        return self.points.get(VALID_PREFIX + name, {}) if name else {}

    def code_perplexity(self) -> tuple[float, float] | None:
        """(perplexity, its collapse floor) of the last validation's codewords; None
        without an interface that picks codes."""
        values = self.points.get(CODE_METRICS[0], {})
        if not values:
            return None
        step = max(values)
        tokens = self.points[CODE_METRICS[1]][step]
        codewords = self.points[CODE_METRICS[2]][step]
        return values[step], COLLAPSE_SHARE * min(tokens, codewords)

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
        if match is not None:
            step, values = int(match.group(1)), match.group(3)
            speed = float(match.group(2).replace(",", ""))
            points.setdefault("tokens_per_s", {})[step] = speed
        elif (match := _VALIDATION.match(line.strip())) is not None:
            step, values = int(match.group(1)), match.group(2)
        else:
            continue
        for name, value in _VALUE.findall(values):
            if name in CURVE_METRICS:
                points.setdefault(name, {})[step] = float(value)
    if not points:
        raise CompareError(f"{log} holds no progress line of a training step")
    return Curve(system, points, str(log))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _below(values: dict[int, float], uniform: float) -> str:
    """The first step whose value is under ``uniform``, or '-'."""
    return str(next((step for step in sorted(values) if values[step] < uniform), "-"))


def _last(values: dict[int, float]) -> float | None:
    return values[max(values)] if values else None


def curves_table(curves: Sequence[Curve], vocab_size: int) -> str:
    """Markdown: a summary per system, then each step's encoder MLM and decoder-stage loss per
    system (nats a token; validation where the runs validated, else training), with the
    uniform guess ln V above them."""
    uniform = math.log(vocab_size)
    lines = [
        f"Uniform guess: ln {vocab_size:,} = {uniform:.2f} nats a token (a model that has "
        "learnt nothing; the MLM and the decoder's loss alike). Validation: the same held-out "
        "sentences and masks each time, eval mode, noise-free codes; training: one batch at "
        "each logged step.",
        "",
        "| system | steps | validation MLM | below uniform from step | training MLM | "
        "decoder stage | codeword perplexity (collapse under) | tokens/s (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for curve in curves:
        valid, decoder = curve.valid_encoder, curve.valid_decoder or curve.decoder
        below = _below(valid or curve.encoder, uniform)
        last_decoder = f"{curve.decoder_metric} {_last(decoder):.2f}" if decoder else "-"
        codes = curve.code_perplexity()
        speed = curve.tokens_per_s()
        lines.append(
            f"| {curve.system} | {max(curve.steps)} | {_number(_last(valid))} | {below} | "
            f"{_number(_last(curve.encoder))} | {last_decoder} | "
            f"{'-' if codes is None else f'{codes[0]:,.0f} ({codes[1]:,.0f})'} | "
            f"{'-' if speed is None else f'{speed:,.0f}'} |"
        )
    columns: list[tuple[str, dict[int, float]]] = []
    for curve in curves:
        if curve.valid_encoder:
            columns.append((f"{curve.system}: valid MLM", curve.valid_encoder))
        columns.append((f"{curve.system}: MLM", curve.encoder))
        if curve.decoder_metric:
            valid = bool(curve.valid_decoder)
            name = f"{'valid ' if valid else ''}{curve.decoder_metric}"
            columns.append((f"{curve.system}: {name}", curve.valid_decoder or curve.decoder))
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
    that have one, each panel with the uniform guess ln V as a dashed line; validation as
    solid lines with markers, training as thin faint ones in the same colour."""
    from matplotlib.ticker import MaxNLocator

    uniform = math.log(vocab_size)
    panels = [("encoder stage: MLM", [(c.system, c.encoder, c.valid_encoder) for c in curves])]
    decoders = [(c.system, c.decoder, c.valid_decoder) for c in curves if c.decoder]
    if decoders:
        panels.append(("decoder stage: loss", decoders))
    fig = _figure(6.0 * len(panels), 4.5)
    colors = {curve.system: f"C{i % 10}" for i, curve in enumerate(curves)}
    for index, (name, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), index + 1)
        for system, training, valid in series:
            if training:
                steps = sorted(training)
                ax.plot(
                    steps,
                    [training[s] for s in steps],
                    label=f"{system} (training)" if valid else system,
                    color=colors[system],
                    alpha=0.35 if valid else 1.0,
                    linewidth=1.0 if valid else 1.5,
                )
            if valid:
                steps = sorted(valid)
                ax.plot(
                    steps,
                    [valid[s] for s in steps],
                    label=f"{system} (validation)",
                    color=colors[system],
                    marker="o",
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
