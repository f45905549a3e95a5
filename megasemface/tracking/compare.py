"""Compare runs tracked in MLflow: select them, tabulate params and metrics, plot them.

Usage::

    records = select_runs("sqlite:///runs/demo/mlflow.db", tags={"stage": "finetune"})
    print(format_table(records, DEFAULT_COLUMNS, "markdown"))
    plot_curves(records, "loss.png", metric="loss")
    plot_bars(records, "bleu.png", metric="test_bleu")

What the trainer logs, and so what this module reads: tags ``stage``, ``interface``,
``git_commit``, ``system`` and ``direction`` (fine-tuning), lineage tags
``parent_<role>_run`` holding the MLflow run id of a parent run (``parent_encoder_run``,
``parent_decoder_run``, ``parent_init_run``); params flattened from the resolved config with
dotted keys (``train.preset``, ``model.d_model``, ``deepspeed.zero_optimization.stage``);
metrics per step (``loss``, ``lr``, ``valid_bleu``, ``test_bleu``, ...).

Columns are named as in MLflow's own search results: ``tags.<key>``, ``params.<key>``,
``metrics.<key>``, or one of the run attributes ``name``, ``run_id``, ``experiment``,
``status``, ``start``, ``duration`` and ``lineage``.

Plots are drawn with matplotlib's object-oriented API on its Agg canvas (no pyplot, no
display, no global backend switch), so they work on headless machines and from threads.
"""

from __future__ import annotations

import csv
import datetime
import functools
import io
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Experiment, Run

__all__ = [
    "DEFAULT_COLUMNS",
    "SYSTEM_ORDER",
    "Column",
    "CompareError",
    "MetricAgg",
    "ParentLink",
    "RunRecord",
    "TableFormat",
    "build_filter",
    "format_lineage",
    "format_table",
    "metric_history",
    "metric_value",
    "parse_column",
    "plot_bars",
    "plot_curves",
    "resolve_param_key",
    "resolve_tracking_uri",
    "select_runs",
]

MetricAgg = Literal["last", "min", "max"]
TableFormat = Literal["table", "markdown", "csv"]

DEFAULT_COLUMNS: tuple[str, ...] = (
    "name",
    "tags.system",
    "tags.stage",
    "tags.interface",
    "tags.direction",
    "metrics.loss",
    "metrics.valid_bleu",
    "metrics.test_bleu",
    "metrics.test_chrf",
    "status",
    "duration",
    "lineage",
)

# The paper's comparison, in its order; other systems follow in the order first seen.
SYSTEM_ORDER: tuple[str, ...] = ("Transformer", "XLM", "mBART", "CL-SemFace", "VQ-SemFace")

_ATTRIBUTES: dict[str, str] = {
    "name": "run",
    "run_id": "run_id",
    "experiment": "experiment",
    "status": "status",
    "start": "start",
    "duration": "duration",
    "lineage": "lineage",
}
_PREFIXES: dict[str, Literal["tag", "param", "metric"]] = {
    "tags.": "tag",
    "params.": "param",
    "metrics.": "metric",
}
_PARENT_TAG = re.compile(r"^parent_(.+)_run$")
_ROLE_ORDER = ("encoder", "decoder", "init")
_MAX_LINEAGE_DEPTH = 8  # lineage chains are two or three runs deep; this only stops runaways
_MISSING = "-"


class CompareError(ValueError):
    """Bad input to a comparison: an unknown store, experiment, run, column or filter."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParentLink:
    """One parent run named by a ``parent_<role>_run`` tag, with its own parents."""

    role: str
    run_id: str
    found: bool
    name: str | None = None
    stage: str | None = None
    deleted: bool = False
    cycle: bool = False  # the chain came back to a run already on it (a mis-tagged store)
    parents: tuple[ParentLink, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    """What a comparison needs of one MLflow run; ``tracking_uri`` is where it came from.

    ``metrics`` holds each metric's last value (MLflow's latest: highest step, then newest);
    :func:`metric_value` and :func:`metric_history` read the full history when asked.
    """

    run_id: str
    name: str
    experiment: str
    status: str
    start_time_ms: int | None
    end_time_ms: int | None
    params: Mapping[str, str]
    tags: Mapping[str, str]
    metrics: Mapping[str, float]
    tracking_uri: str
    lineage: tuple[ParentLink, ...] = field(default=())

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end; None while the run has not ended."""
        if self.start_time_ms is None or self.end_time_ms is None:
            return None
        return (self.end_time_ms - self.start_time_ms) / 1000.0

    @property
    def parent_runs(self) -> dict[str, str]:
        """``{role: run_id}`` from the run's ``parent_<role>_run`` tags."""
        return _parent_tags(self.tags)


# --------------------------------------------------------------------------------------------
# Store and selection
# --------------------------------------------------------------------------------------------


def resolve_tracking_uri(uri: str | os.PathLike[str] | None) -> str:
    """The MLflow tracking URI to read, checked so that a typo does not create an empty store.

    ``uri`` may be a tracking URI, the path of an ``mlflow.db`` file, or a training output
    directory holding one; None means ``MLFLOW_TRACKING_URI``. An ``sqlite:`` URI must name an
    existing file: MLflow would otherwise create a new, empty database there.
    """
    if uri is None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    if uri is None:
        raise CompareError(
            "no MLflow store given: pass --tracking-uri (e.g. sqlite:///runs/demo/mlflow.db, "
            "or the output directory of a training run) or set MLFLOW_TRACKING_URI"
        )
    text = os.fspath(uri)
    if "://" not in text and not text.startswith("sqlite:"):
        path = Path(text)
        if path.is_dir() and (path / "mlflow.db").is_file():
            path = path / "mlflow.db"
        if not path.is_file():
            raise CompareError(
                f"{text} is neither a tracking URI nor an MLflow database (or a directory "
                "with mlflow.db in it); pass e.g. sqlite:///runs/demo/mlflow.db"
            )
        return f"sqlite:///{path.resolve()}"
    if text.startswith("sqlite:"):
        db = text.removeprefix("sqlite:").removeprefix("///").split("?", 1)[0]
        if not db or db == ":memory:" or not Path(db).is_file():
            raise CompareError(
                f"no MLflow database at {db or text!r} (from {text}): check the path; a "
                "training run writes <output_dir>/mlflow.db"
            )
    return text


@functools.lru_cache(maxsize=8)
def _client(tracking_uri: str) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def _quote(value: str) -> str:
    """``value`` as an MLflow filter string literal."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise CompareError(
        f"tag value {value!r} has both kinds of quotes, which MLflow filters cannot express; "
        "select these runs with --run-id instead"
    )


def build_filter(
    tags: Mapping[str, str] | None = None, filter_string: str = "", run_ids: Sequence[str] = ()
) -> str:
    """One MLflow filter string: tag equalities, the raw filter and a run id list, ANDed."""
    clauses = []
    for key, value in (tags or {}).items():
        if not key or "`" in key:
            raise CompareError(f"invalid tag key {key!r}: give tags as KEY=VALUE")
        clauses.append(f"tags.`{key}` = {_quote(str(value))}")
    if filter_string.strip():
        clauses.append(filter_string.strip())
    if run_ids:
        clauses.append(f"attributes.run_id IN ({', '.join(_quote(r) for r in run_ids)})")
    return " AND ".join(clauses)


def _all_experiments(client: MlflowClient) -> list[Experiment]:
    """Every active experiment of the store, page by page."""
    experiments: list[Experiment] = []
    token = None
    while True:
        page = client.search_experiments(page_token=token)
        experiments.extend(page)
        token = page.token
        if not token:
            return experiments


def _experiment_ids(client: MlflowClient, names: Sequence[str], uri: str) -> list[str]:
    """Ids of the named experiments (all active ones when none are named)."""
    if not names:
        return [e.experiment_id for e in _all_experiments(client)]
    ids = []
    for name in names:
        experiment = client.get_experiment_by_name(name)
        if experiment is None or experiment.lifecycle_stage == "deleted":
            known = sorted(e.name for e in _all_experiments(client))
            raise CompareError(
                f"no experiment named {name!r} at {uri}; experiments there: "
                f"{', '.join(known) or 'none'}"
            )
        ids.append(experiment.experiment_id)
    return ids


def select_runs(
    tracking_uri: str | os.PathLike[str] | None = None,
    *,
    experiments: Sequence[str] = (),
    tags: Mapping[str, str] | None = None,
    filter_string: str = "",
    run_ids: Sequence[str] = (),
    max_results: int = 1000,
    lineage: bool = True,
) -> list[RunRecord]:
    """The runs matching every criterion given, oldest first (or in ``run_ids`` order).

    Args:
        tracking_uri: see :func:`resolve_tracking_uri`.
        experiments: experiment names; none: every active experiment.
        tags: ``{key: value}`` that each run's tags must equal.
        filter_string: a raw MLflow filter, e.g. ``"metrics.test_bleu > 20"``.
        run_ids: only these runs (each must exist; deleted ones included).
        max_results: at most this many runs.
        lineage: resolve each run's parent chain (one lookup per distinct parent).

    Returns:
        The matching runs; empty when none matched.

    Raises:
        CompareError: unknown store, experiment or run id, or a filter MLflow rejects.
    """
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    uri = resolve_tracking_uri(tracking_uri)
    client = _client(uri)
    cache: dict[str, Run | None] = {}
    run_ids = list(dict.fromkeys(run_ids))
    explicit = [_fetch(client, run_id, cache) for run_id in run_ids]
    for run_id, run in zip(run_ids, explicit, strict=True):
        if run is None:
            raise CompareError(f"run {run_id!r} does not exist at {uri}")
    experiment_ids = _experiment_ids(client, experiments, uri)
    if run_ids and not experiments:
        # Explicit runs may sit in any experiment, a deleted one included.
        experiment_ids = sorted({run.info.experiment_id for run in explicit if run})
    query = build_filter(tags, filter_string, run_ids)
    if not experiment_ids:
        return []
    runs: list[Run] = []
    token = None
    try:
        while len(runs) < max_results:
            page = client.search_runs(
                experiment_ids,
                query,
                run_view_type=ViewType.ALL if run_ids else ViewType.ACTIVE_ONLY,
                max_results=min(max_results - len(runs), 1000),
                order_by=["attributes.start_time ASC", "attributes.run_name ASC"],
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                break
    except MlflowException as exc:
        if exc.error_code != "INVALID_PARAMETER_VALUE":
            raise
        raise CompareError(
            f"MLflow rejected the filter {query!r}: {exc.message}. A filter looks like "
            "\"tags.stage = 'finetune' and metrics.test_bleu > 20\""
        ) from exc
    if run_ids:
        position = {run_id: i for i, run_id in enumerate(run_ids)}
        runs.sort(key=lambda run: position[run.info.run_id])
    cache.update({run.info.run_id: run for run in runs})
    experiment_names: dict[str, str] = {}
    records = []
    for run in runs:
        exp_id = run.info.experiment_id
        if exp_id not in experiment_names:
            experiment_names[exp_id] = client.get_experiment(exp_id).name
        links = _lineage(client, run, cache, (run.info.run_id,), 0) if lineage else ()
        records.append(_record(run, experiment_names[exp_id], uri, links))
    return records


def _record(run: Run, experiment: str, uri: str, links: tuple[ParentLink, ...]) -> RunRecord:
    info, data = run.info, run.data
    return RunRecord(
        run_id=info.run_id,
        name=info.run_name or info.run_id,
        experiment=experiment,
        status=info.status,
        start_time_ms=info.start_time,
        end_time_ms=info.end_time,
        params=dict(data.params),
        tags=dict(data.tags),
        metrics=dict(data.metrics),
        tracking_uri=uri,
        lineage=links,
    )


def _fetch(client: MlflowClient, run_id: str, cache: dict[str, Run | None]) -> Run | None:
    """The run (looked up once per comparison), or None when the store does not know it."""
    from mlflow.exceptions import MlflowException

    if run_id not in cache:
        try:
            cache[run_id] = client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            cache[run_id] = None
    return cache[run_id]


def _parent_tags(tags: Mapping[str, str]) -> dict[str, str]:
    found = {}
    for key, value in tags.items():
        match = _PARENT_TAG.match(key)
        if match and value.strip():
            found[match.group(1)] = value.strip()
    order = {role: i for i, role in enumerate(_ROLE_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _lineage(
    client: MlflowClient,
    run: Run,
    cache: dict[str, Run | None],
    path: tuple[str, ...],
    depth: int,
) -> tuple[ParentLink, ...]:
    links = []
    for role, parent_id in _parent_tags(run.data.tags).items():
        parent = _fetch(client, parent_id, cache)
        if parent is None:
            links.append(ParentLink(role, parent_id, found=False))
            continue
        cycle = parent_id in path
        grand = ()
        if not cycle and depth < _MAX_LINEAGE_DEPTH:
            grand = _lineage(client, parent, cache, (*path, parent_id), depth + 1)
        links.append(
            ParentLink(
                role,
                parent_id,
                found=True,
                name=parent.info.run_name or parent_id,
                stage=parent.data.tags.get("stage"),
                deleted=parent.info.lifecycle_stage == "deleted",
                cycle=cycle,
                parents=grand,
            )
        )
    return tuple(links)


def format_lineage(links: Sequence[ParentLink]) -> str:
    """E.g. ``encoder: vq-enc (encoder), decoder: vq-dec (decoder) [encoder: vq-enc (encoder)]``.

    A parent's own parents follow it in square brackets; a parent the store does not know
    reads ``encoder: missing run <id>``.
    """
    parts = []
    for link in links:
        if not link.found:
            parts.append(f"{link.role}: missing run {link.run_id}")
            continue
        notes = [n for n in (link.stage, "deleted" if link.deleted else None) if n]
        text = f"{link.role}: {link.name}" + (f" ({', '.join(notes)})" if notes else "")
        if link.cycle:
            text += " [cycle]"
        elif link.parents:
            text += f" [{format_lineage(link.parents)}]"
        parts.append(text)
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Metrics and columns
# --------------------------------------------------------------------------------------------


def metric_history(record: RunRecord, key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of one metric of the run, by step (empty if never logged)."""
    if key not in record.metrics:
        return []
    points = _client(record.tracking_uri).get_metric_history(record.run_id, key)
    return [(m.step, m.value) for m in sorted(points, key=lambda m: (m.step, m.timestamp))]


def metric_value(record: RunRecord, key: str, agg: MetricAgg = "last") -> float | None:
    """The run's last, lowest or highest value of a metric (NaNs ignored); None if absent."""
    if agg not in get_args(MetricAgg):
        raise CompareError(f"unknown metric aggregation {agg!r}; use one of last, min, max")
    if agg == "last" or key not in record.metrics:
        return record.metrics.get(key)
    values = [v for _, v in metric_history(record, key) if not math.isnan(v)]
    if not values:
        return math.nan
    return min(values) if agg == "min" else max(values)


def resolve_param_key(records: Iterable[RunRecord], key: str) -> str:
    """``key`` itself if a run has it, else the one dotted key ending in ``.key``.

    Lets ``preset`` stand for ``train.preset``. A key matching nothing is returned unchanged
    (its column stays blank); one matching several raises naming them.
    """
    records = list(records)
    if any(key in r.params for r in records):
        return key
    matches = sorted({k for r in records for k in r.params if k.endswith(f".{key}")})
    if len(matches) > 1:
        raise CompareError(f"param {key!r} is ambiguous ({', '.join(matches)}): give the full key")
    return matches[0] if matches else key


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: a run attribute, or a tag, param or metric by key."""

    kind: Literal["attribute", "tag", "param", "metric"]
    key: str

    @property
    def spec(self) -> str:
        """The column as written in a column list (``tags.system``, ``duration``)."""
        return self.key if self.kind == "attribute" else f"{self.kind}s.{self.key}"

    def header(self, metric_agg: MetricAgg = "last") -> str:
        """Column title: the key alone (``system``, ``test_bleu (max)``)."""
        if self.kind == "attribute":
            return _ATTRIBUTES[self.key]
        if self.kind == "metric" and metric_agg != "last":
            return f"{self.key} ({metric_agg})"
        return self.key


def parse_column(spec: str | Column) -> Column:
    """``"tags.system"``, ``"params.train.preset"``, ``"metrics.loss"`` or an attribute name."""
    if isinstance(spec, Column):
        return spec
    text = spec.strip()
    if text in _ATTRIBUTES:
        return Column("attribute", text)
    for prefix, kind in _PREFIXES.items():
        if text.startswith(prefix) and len(text) > len(prefix):
            return Column(kind, text[len(prefix) :])
    raise CompareError(
        f"unknown column {spec!r}: use tags.<key>, params.<key>, metrics.<key> or one of "
        f"{', '.join(_ATTRIBUTES)}"
    )


def _cell(record: RunRecord, column: Column, agg: MetricAgg) -> str | float | None:
    """The raw value of one cell; None where the run has none."""
    if column.kind == "tag":
        return record.tags.get(column.key) or None
    if column.kind == "param":
        return record.params.get(column.key)
    if column.kind == "metric":
        return metric_value(record, column.key, agg)
    if column.key == "name":
        return record.name
    if column.key == "run_id":
        return record.run_id
    if column.key == "experiment":
        return record.experiment
    if column.key == "status":
        return record.status
    if column.key == "duration":
        return record.duration_s
    if column.key == "start":
        return None if record.start_time_ms is None else _iso(record.start_time_ms)
    return format_lineage(record.lineage) or None


def _iso(ms: int) -> str:
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _human_duration(seconds: float) -> str:
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _human_number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def _render(value: str | float | None, column: Column, fmt: TableFormat) -> str:
    if value is None:
        return "" if fmt == "csv" else _MISSING
    if isinstance(value, str):
        return value
    if fmt == "csv":
        # Full precision: the CSV is for reading back, not for eyes.
        return repr(round(value, 3)) if column.key == "duration" else repr(value)
    if column.kind == "attribute" and column.key == "duration":
        return _human_duration(value)
    return _human_number(value)


def format_table(
    records: Sequence[RunRecord],
    columns: Sequence[str | Column] = DEFAULT_COLUMNS,
    fmt: TableFormat = "table",
    *,
    metric_agg: MetricAgg = "last",
) -> str:
    """The runs as a table: aligned plain text, a Markdown table or CSV (with a header row).

    Missing values are ``-`` in text and Markdown and empty in CSV. CSV numbers keep full
    precision (durations in seconds, start times in ISO 8601 UTC).
    """
    if fmt not in get_args(TableFormat):
        raise CompareError(f"unknown table format {fmt!r}; use one of table, markdown, csv")
    cols = [parse_column(c) for c in columns]
    if not cols:
        raise CompareError("no columns to show")
    raw = [[_cell(r, c, metric_agg) for c in cols] for r in records]
    headers = [c.header(metric_agg) for c in cols]
    rows = [[_render(v, c, fmt) for v, c in zip(row, cols, strict=True)] for row in raw]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows(rows)
        return out.getvalue()
    # Numbers are right-aligned: a column of numbers (and blanks) reads by magnitude.
    numeric = [
        any(isinstance(row[i], float | int) for row in raw)
        and all(v is None or isinstance(v, float | int) for v in (row[i] for row in raw))
        for i in range(len(cols))
    ]
    if fmt == "markdown":
        cells = [[_md_escape(text) for text in row] for row in [headers, *rows]]
        rule = ["---:" if num else "---" for num in numeric]
        lines = [cells[0], rule, *cells[1:]]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(cols))]
    lines = []
    for row in [headers, ["-" * w for w in widths], *rows]:
        padded = [
            text.rjust(w) if num else text.ljust(w)
            for text, w, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


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
    range as an error bar. Runs without the metric are left out.
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
        for g, group in enumerate(groups):
            found = values.get((group, system))
            if not found:
                continue
            mean = sum(found) / len(found)
            xs.append(g + (i - (len(systems) - 1) / 2) * width if len(groups) > 1 else i)
            means.append(mean)
            low.append(mean - min(found))
            high.append(max(found) - mean)
        spread = [low, high] if any(low) or any(high) else None
        bars = ax.bar(xs, means, width, label=system, color=colors[i], yerr=spread, capsize=3)
        ax.bar_label(bars, fmt="%.1f", fontsize="small")
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
