"""Run records and their selection: the MLflow store, filters, lineage and metric values.

Part of :mod:`megasemface.tracking.compare`, which re-exports the public names.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from megasemface.tracking.mlflow_names import PARENT_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Experiment, Run

__all__ = [
    "CompareError",
    "MetricAgg",
    "ParentLink",
    "RunRecord",
    "build_filter",
    "format_lineage",
    "metric_history",
    "metric_value",
    "resolve_param_key",
    "resolve_tracking_uri",
    "select_runs",
]

MetricAgg = Literal["last", "min", "max"]

_ROLE_ORDER = ("encoder", "decoder", "init")
_MAX_LINEAGE_DEPTH = 8  # lineage chains are two or three runs deep; this only stops runaways


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
    registered: tuple[str, ...] = field(default=())
    """The run's registered model versions, ``NAME/VERSION``."""

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
        _check_sqlite(path)
        return f"sqlite:///{path.resolve()}"
    if text.startswith("sqlite:"):
        db = text.removeprefix("sqlite:").removeprefix("///").split("?", 1)[0]
        if not db or db == ":memory:" or not Path(db).is_file():
            raise CompareError(
                f"no MLflow database at {db or text!r} (from {text}): check the path; a "
                "training run writes <output_dir>/mlflow.db"
            )
        _check_sqlite(Path(db))
    return text


def _check_sqlite(path: Path) -> None:
    """Refuses a file that is not an SQLite database, which MLflow's store would report as a
    traceback from deep inside SQLAlchemy."""
    with open(path, "rb") as handle:
        header = handle.read(16)
    if header != b"SQLite format 3\x00":
        raise CompareError(
            f"{path} is not an MLflow database (not an SQLite file); pass the mlflow.db a "
            "training run wrote, e.g. sqlite:///runs/demo/mlflow.db"
        )


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
    registered: Sequence[str] = (),
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
        registered: also the runs of these registered model versions (``NAME``,
            ``NAME:VERSION`` or ``NAME@ALIAS``), after ``run_ids``.

    Returns:
        The matching runs; empty when none matched.

    Raises:
        CompareError: unknown store, experiment, run id or registered version, or a filter
            MLflow rejects.
    """
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    from megasemface.tracking.compare.registered import registered_run_ids, registered_versions

    uri = resolve_tracking_uri(tracking_uri)
    client = _client(uri)
    cache: dict[str, Run | None] = {}
    run_ids = list(dict.fromkeys([*run_ids, *registered_run_ids(client, registered, uri)]))
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
    versions = registered_versions(client, [run.info.run_id for run in runs])
    records = []
    for run in runs:
        exp_id = run.info.experiment_id
        if exp_id not in experiment_names:
            experiment_names[exp_id] = client.get_experiment(exp_id).name
        links = _lineage(client, run, cache, (run.info.run_id,), 0) if lineage else ()
        registered_as = versions.get(run.info.run_id, ())
        records.append(_record(run, experiment_names[exp_id], uri, links, registered_as))
    return records


def _record(
    run: Run,
    experiment: str,
    uri: str,
    links: tuple[ParentLink, ...],
    registered: tuple[str, ...],
) -> RunRecord:
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
        registered=registered,
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
        match = PARENT_TAG.match(key)
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
# Metrics
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
