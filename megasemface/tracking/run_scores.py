"""Logging evaluation scores (BLEU, chrF, ...), their signatures and the files they were
computed from to an existing MLflow run."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["log_scores"]


def log_scores(
    tracking_uri: str,
    run_id: str,
    scores: Mapping[str, float],
    tags: Mapping[str, str],
    *,
    step: int | None = None,
    files: Sequence[str | os.PathLike[str]] = (),
    texts: Mapping[str, str] | None = None,
    artifact_path: str | None = None,
) -> None:
    """Logs ``scores`` as metrics of the run ``run_id`` (at ``step``; MLflow's 0 when None)
    and ``tags``, typically the metrics' signatures, as its tags; ``files`` (e.g. the
    translations scored) and ``texts`` (name -> content, e.g. the scores as JSON) as its
    artifacts, under ``artifact_path``.

    Synchronous (one request per value): meant for the end of an evaluation, not for a
    training step's hot path.
    """
    from mlflow.tracking import MlflowClient  # slow to import; only evaluation needs it

    client = MlflowClient(tracking_uri)
    client.get_run(run_id)  # fails with MLflow's own clear message for an unknown run
    for name, score in scores.items():
        client.log_metric(run_id, name, float(score), step=step)
    for name, value in tags.items():
        client.set_tag(run_id, name, value)
    for path in files:
        client.log_artifact(run_id, os.fspath(path), artifact_path)
    for name, text in (texts or {}).items():
        client.log_text(run_id, text, f"{artifact_path}/{name}" if artifact_path else name)
