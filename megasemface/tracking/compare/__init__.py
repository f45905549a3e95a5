"""Compare runs tracked in MLflow: select them, tabulate params and metrics, plot them.

Usage::

    records = select_runs("sqlite:///runs/demo/mlflow.db", tags={"stage": "finetune"})
    print(format_table(records, DEFAULT_COLUMNS, "markdown"))
    plot_curves(records, "loss.png", metric="loss")
    plot_bars(records, "bleu.png", metric="test_bleu")

What the trainer logs, and so what this package reads: tags ``stage``, ``interface``,
``git_commit``, ``system`` and ``direction`` (fine-tuning), lineage tags
``parent_<role>_run`` holding the MLflow run id of a parent run (``parent_encoder_run``,
``parent_decoder_run``, ``parent_init_run``); params flattened from the resolved config with
dotted keys (``train.preset``, ``model.d_model``, ``deepspeed.zero_optimization.stage``);
metrics per step (``loss``, ``lr``, ``valid_bleu``, ``test_bleu``, ...).

Columns are named as in MLflow's own search results: ``tags.<key>``, ``params.<key>``,
``metrics.<key>``, or one of the run attributes ``name``, ``run_id``, ``experiment``,
``status``, ``start``, ``duration``, ``lineage`` and ``registered`` (the run's versions in
the model registry, ``NAME/VERSION``).

Plots are drawn with matplotlib's object-oriented API on its Agg canvas (no pyplot, no
display, no global backend switch), so they work on headless machines and from threads.

The submodules, whose public names are all re-exported here:

- :mod:`~megasemface.tracking.compare.runs`: :class:`RunRecord`, :class:`ParentLink`,
  :class:`CompareError`; the store and selection (:func:`resolve_tracking_uri`,
  :func:`build_filter`, :func:`select_runs`), lineage (:func:`format_lineage`) and metric
  values (:func:`metric_history`, :func:`metric_value`, :func:`resolve_param_key`).
- :mod:`~megasemface.tracking.compare.registered`: the runs of registered model versions
  (:func:`registered_run_ids`) and the versions of runs (:func:`registered_versions`).
- :mod:`~megasemface.tracking.compare.table`: columns (:data:`DEFAULT_COLUMNS`,
  :class:`Column`, :func:`parse_column`) and :func:`format_table`.
- :mod:`~megasemface.tracking.compare.plots`: :func:`plot_curves`, :func:`plot_bars` and
  :data:`SYSTEM_ORDER`.
- :mod:`~megasemface.tracking.compare.curves`: pre-training learning curves side by side
  (:class:`Curve`, :func:`curve_from_mlflow`, :func:`curve_from_log`, :func:`curves_table`,
  :func:`plot_learning_curves`).
"""

from megasemface.tracking.compare.curves import (
    Curve,
    curve_from_log,
    curve_from_mlflow,
    curves_table,
    plot_learning_curves,
)
from megasemface.tracking.compare.plots import SYSTEM_ORDER, plot_bars, plot_curves
from megasemface.tracking.compare.registered import registered_run_ids, registered_versions
from megasemface.tracking.compare.runs import (
    CompareError,
    MetricAgg,
    ParentLink,
    RunRecord,
    build_filter,
    format_lineage,
    metric_history,
    metric_value,
    resolve_param_key,
    resolve_tracking_uri,
    select_runs,
)
from megasemface.tracking.compare.table import (
    DEFAULT_COLUMNS,
    Column,
    TableFormat,
    format_table,
    parse_column,
)

__all__ = [
    "DEFAULT_COLUMNS",
    "SYSTEM_ORDER",
    "Column",
    "CompareError",
    "Curve",
    "MetricAgg",
    "ParentLink",
    "RunRecord",
    "TableFormat",
    "build_filter",
    "curve_from_log",
    "curve_from_mlflow",
    "curves_table",
    "format_lineage",
    "format_table",
    "metric_history",
    "metric_value",
    "parse_column",
    "plot_bars",
    "plot_curves",
    "plot_learning_curves",
    "registered_run_ids",
    "registered_versions",
    "resolve_param_key",
    "resolve_tracking_uri",
    "select_runs",
]
