"""Logging evaluation scores (BLEU, chrF, ...) and their signatures to an existing MLflow run."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["log_scores"]


def log_scores(
    tracking_uri: str,
    run_id: str,
    scores: Mapping[str, float],
    tags: Mapping[str, str],
    *,
    step: int | None = None,
) -> None:
    """Logs ``scores`` as metrics of the run ``run_id`` (at ``step``; MLflow's 0 when None)
    and ``tags``, typically the metrics' signatures, as its tags.

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
