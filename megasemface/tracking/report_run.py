"""The comparison's own MLflow run: the report a pipeline writes, where the UI shows it.

One run per work directory (found again by its ``report_workdir`` tag, so re-running the
pipeline updates it instead of adding runs), tagged ``stage=report`` so filters on the
training stages leave it out. Its description is the report's Markdown (tables render on the
run's page); its artifacts are the report and its plots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from megasemface.tracking.mlflow_names import MAX_TAG_VALUE_LEN

__all__ = ["REPORT_STAGE", "log_report_run"]

REPORT_STAGE = "report"
_KEY_TAG = "report_workdir"
_NOTE_TAG = "mlflow.note.content"


def log_report_run(
    tracking_uri: str,
    experiment: str,
    workdir: str | os.PathLike[str],
    markdown: Path,
    plots: Sequence[Path],
) -> str | None:
    """Creates or updates the report run of ``workdir`` in ``experiment``; returns its id
    (None when the experiment does not exist: no run was tracked, there is nothing to show)."""
    from mlflow.tracking import MlflowClient  # slow to import; only the report needs it

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    key = str(Path(workdir).resolve())
    runs = client.search_runs(
        [found.experiment_id], filter_string=f"tags.{_KEY_TAG} = '{key}'", max_results=1
    )
    if runs:
        run_id = runs[0].info.run_id
    else:
        name = f"comparison-{Path(key).name}"
        run_id = client.create_run(found.experiment_id, run_name=name).info.run_id
    text = markdown.read_text(encoding="utf-8")
    if len(text) > MAX_TAG_VALUE_LEN:
        cut = f"\n\n(cut here: the whole report is the artifact {markdown.name})"
        text = text[: MAX_TAG_VALUE_LEN - len(cut)] + cut
    for name, value in ((_KEY_TAG, key), ("stage", REPORT_STAGE), (_NOTE_TAG, text)):
        client.set_tag(run_id, name, value)
    for path in (markdown, *plots):
        client.log_artifact(run_id, os.fspath(path))
    client.set_terminated(run_id, "FINISHED")
    return run_id
