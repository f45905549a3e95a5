"""Compares runs tracked in MLflow: a table of params and metrics with lineage, and plots.

Examples::

    python tools/compare_runs.py --tracking-uri sqlite:///runs/demo/mlflow.db \\
        --tag stage=finetune --format markdown --output results.md --plot-bleu bleu.png
    python tools/compare_runs.py --tracking-uri runs/demo --experiment pretrain \\
        --param preset --metric loss --metric enc_mlm --plot-loss loss.png
    python tools/compare_runs.py --filter "metrics.test_bleu > 20" --format csv
    python tools/compare_runs.py --tracking-uri runs/demo --registered megasemface-en-de-cl:1 \\
        --registered megasemface-en-de-vq@best

Exit status: 0 on success, 1 when no run matched, 2 for bad input (store, experiment, run id,
registered version, filter, column).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megasemface.cli.parsing import command_parser
from megasemface.tracking.compare import (
    DEFAULT_COLUMNS,
    Column,
    CompareError,
    RunRecord,
    build_filter,
    format_table,
    parse_column,
    plot_bars,
    plot_curves,
    resolve_param_key,
    resolve_tracking_uri,
    select_runs,
)

__all__ = ["build_parser", "main"]

PROG = "compare_runs"
_IDENTITY = DEFAULT_COLUMNS[:5]  # name, system, stage, interface, direction
_DEFAULT_METRICS = [c.removeprefix("metrics.") for c in DEFAULT_COLUMNS if c.startswith("metrics.")]
_TRAILING = ("registered", "status", "duration", "lineage")
_ALWAYS_SHOWN = {"name", "status", "duration"}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    parser = command_parser(__doc__, prog=PROG)
    parser.epilog = f"{parser.epilog}\n\nexit status: 0 ok, 1 no run matched, 2 bad input."
    store = parser.add_argument_group("selection")
    store.add_argument(
        "--tracking-uri",
        help="MLflow store: a URI (sqlite:///runs/demo/mlflow.db, http://host:5000), an "
        "mlflow.db file or a training output directory (default: MLFLOW_TRACKING_URI)",
    )
    store.add_argument(
        "--experiment", action="append", default=[], help="experiment name (repeat for several)"
    )
    store.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only runs with this tag value, e.g. stage=finetune (repeat: all must hold)",
    )
    store.add_argument(
        "--filter", default="", help='raw MLflow filter, e.g. "metrics.test_bleu > 20"'
    )
    store.add_argument(
        "--run-id", action="append", default=[], help="only this run (repeat; keeps the order)"
    )
    store.add_argument(
        "--registered",
        action="append",
        default=[],
        metavar="NAME[:VERSION]",
        help="the runs of a registered model's versions: NAME (all), NAME:VERSION or "
        "NAME@ALIAS, e.g. megasemface-en-de-cl@best (repeat; with --run-id: either)",
    )
    store.add_argument("--max-runs", type=int, default=1000, help="at most this many runs")

    table = parser.add_argument_group("table")
    table.add_argument(
        "--param",
        action="append",
        default=[],
        help="param column, e.g. train.preset or just preset (repeat)",
    )
    table.add_argument(
        "--metric",
        action="append",
        default=[],
        help=f"metric column (repeat); replaces the default {', '.join(_DEFAULT_METRICS)}",
    )
    table.add_argument(
        "--columns",
        help="the exact columns, comma-separated: name, run_id, experiment, status, start, "
        "duration, lineage, registered, tags.KEY, params.KEY, metrics.KEY (replaces every "
        "default)",
    )
    table.add_argument(
        "--metric-agg",
        choices=("last", "min", "max"),
        default="last",
        help="which value of each metric history to show (default: last)",
    )
    table.add_argument("--format", choices=("table", "markdown", "csv"), default="table")
    table.add_argument("--output", type=Path, help="write the table here instead of stdout")
    table.add_argument("--no-lineage", action="store_true", help="do not look up parent runs")

    plots = parser.add_argument_group("plots (PNG)")
    plots.add_argument("--plot-loss", type=Path, metavar="FILE.png", help="curves per step")
    plots.add_argument("--curve-metric", default="loss", help="metric of --plot-loss curves")
    plots.add_argument("--plot-bleu", type=Path, metavar="FILE.png", help="bars per system")
    plots.add_argument("--bar-metric", default="test_bleu", help="metric of --plot-bleu bars")
    return parser


def _parse_tags(items: Sequence[str]) -> dict[str, str]:
    tags = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CompareError(f"--tag {item!r}: give KEY=VALUE, e.g. --tag stage=finetune")
        tags[key.strip()] = value.strip()
    return tags


def _columns(args: argparse.Namespace, records: list[RunRecord]) -> list[Column]:
    """The table's columns: the user's, or defaults less those blank for every run.

    Blank default columns are dropped from text and Markdown (a pre-training comparison has
    no BLEU) but kept in CSV, so that a CSV's columns do not depend on the data.
    """
    if args.columns:
        return [parse_column(spec) for spec in args.columns.split(",") if spec.strip()]
    params = [Column("param", resolve_param_key(records, key)) for key in args.param]
    identity = [parse_column(c) for c in _IDENTITY]
    metrics = [Column("metric", key) for key in args.metric]
    default_metrics = [] if metrics else [Column("metric", key) for key in _DEFAULT_METRICS]
    trailing = [parse_column(c) for c in _TRAILING if not (c == "lineage" and args.no_lineage)]
    if args.format != "csv":
        identity, default_metrics, trailing = (
            [c for c in group if c.key in _ALWAYS_SHOWN or _any_value(records, c)]
            for group in (identity, default_metrics, trailing)
        )
    return list(dict.fromkeys(identity + params + metrics + default_metrics + trailing))


def _any_value(records: list[RunRecord], column: Column) -> bool:
    if column.kind == "tag":
        return any(r.tags.get(column.key) for r in records)
    if column.kind == "metric":
        return any(column.key in r.metrics for r in records)
    if column.key == "lineage":
        return any(r.lineage for r in records)
    if column.key == "registered":
        return any(r.registered for r in records)
    return True


def _warn_blank(records: list[RunRecord], columns: list[Column]) -> None:
    """Say which requested params or metrics no selected run has (likely a typo)."""
    for column in columns:
        if column.kind == "param" and not any(column.key in r.params for r in records):
            print(f"{PROG}: warning: no selected run has param {column.key!r}", file=sys.stderr)
        if column.kind == "metric" and not any(column.key in r.metrics for r in records):
            print(f"{PROG}: warning: no selected run has metric {column.key!r}", file=sys.stderr)


def _no_match_message(args: argparse.Namespace, uri: str, tags: dict[str, str]) -> str:
    where = f"experiment(s) {', '.join(args.experiment)}" if args.experiment else "any experiment"
    query = build_filter(tags, args.filter, args.run_id)
    return (
        f"{PROG}: no runs matched in {where} at {uri}"
        + (f" with filter: {query}" if query else "")
        + ". Check the names and values; without --experiment, --tag, --filter and --run-id "
        "every run of the store is listed"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns the exit status."""
    from mlflow.exceptions import MlflowException

    args = build_parser().parse_args(argv)
    try:
        if args.max_runs < 1:
            raise CompareError(f"--max-runs must be at least 1, not {args.max_runs}")
        uri = resolve_tracking_uri(args.tracking_uri)
        tags = _parse_tags(args.tag)
        records = select_runs(
            uri,
            experiments=args.experiment,
            tags=tags,
            filter_string=args.filter,
            run_ids=args.run_id,
            max_results=args.max_runs,
            lineage=not args.no_lineage,
            registered=args.registered,
        )
        if not records:
            print(_no_match_message(args, uri, tags), file=sys.stderr)
            return 1
        if len(records) == args.max_runs:
            print(
                f"{PROG}: note: showing the first {args.max_runs} runs; there may be more "
                "(raise --max-runs)",
                file=sys.stderr,
            )
        columns = _columns(args, records)
        _warn_blank(records, columns)
        text = format_table(records, columns, args.format, metric_agg=args.metric_agg)
        if args.output is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text, encoding="utf-8")
            print(f"{PROG}: wrote {args.output} ({len(records)} runs)", file=sys.stderr)
        else:
            sys.stdout.write(text)
        if args.plot_loss is not None:
            _report_skipped(records, args.curve_metric)
            plot_curves(records, args.plot_loss, metric=args.curve_metric)
            print(f"{PROG}: wrote {args.plot_loss}", file=sys.stderr)
        if args.plot_bleu is not None:
            _report_skipped(records, args.bar_metric)
            plot_bars(records, args.plot_bleu, metric=args.bar_metric, metric_agg=args.metric_agg)
            print(f"{PROG}: wrote {args.plot_bleu}", file=sys.stderr)
    except (CompareError, MlflowException, OSError) as exc:
        message = exc.message if isinstance(exc, MlflowException) else str(exc)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    return 0


def _report_skipped(records: list[RunRecord], metric: str) -> None:
    """Name the runs a plot leaves out for lack of the metric (the plot still gets drawn)."""
    missing = [r.name for r in records if metric not in r.metrics]
    if missing and len(missing) < len(records):
        print(
            f"{PROG}: note: {len(missing)} run(s) without metric {metric!r} left out of the "
            f"plot: {', '.join(missing)}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    raise SystemExit(main())
