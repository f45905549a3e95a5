"""Registered model versions of runs: selecting runs by version, and naming each run's versions.

Part of :mod:`megasemface.tracking.compare`, which re-exports the public names. A version is
written ``NAME/VERSION``; a selection ``NAME`` (every version), ``NAME:VERSION`` or
``NAME@ALIAS`` (e.g. ``megasemface-en-de-cl@best``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megasemface.tracking.compare.runs import CompareError

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["registered_run_ids", "registered_versions"]

_IDS_PER_QUERY = 100


def registered_run_ids(client: MlflowClient, specs: Sequence[str], uri: str) -> list[str]:
    """The runs of the versions ``specs`` name, in order, each once."""
    from mlflow.exceptions import MlflowException

    run_ids: list[str] = []
    for spec in specs:
        name, version, alias = _parse(spec)
        try:
            if alias:
                versions = [client.get_model_version_by_alias(name, alias)]
            elif version:
                versions = [client.get_model_version(name, version)]
            else:
                client.get_registered_model(name)
                versions = sorted(
                    client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)
                )
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            raise CompareError(f"no registered model version {spec!r} at {uri}") from exc
        run_ids += [v.run_id for v in versions if v.run_id]
    return list(dict.fromkeys(run_ids))


def _parse(spec: str) -> tuple[str, str, str]:
    """``(name, version, alias)`` of ``NAME``, ``NAME:VERSION`` or ``NAME@ALIAS``."""
    name, _, alias = spec.strip().partition("@")
    head, colon, version = name.rpartition(":")
    if colon and version.isdigit():
        name = head
    else:
        version = ""
    if not name or "'" in name or (spec.count("@") and not alias):
        raise CompareError(
            f"--registered {spec!r}: give NAME, NAME:VERSION or NAME@ALIAS, e.g. "
            "megasemface-en-de-cl:1"
        )
    return name, version, alias


def registered_versions(client: MlflowClient, run_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``{run_id: ("NAME/VERSION", ...)}`` of the runs that have registered versions; empty
    where the store has no model registry."""
    from mlflow.exceptions import MlflowException

    found: dict[str, list[tuple[str, int]]] = {}
    for start in range(0, len(run_ids), _IDS_PER_QUERY):
        chunk = ", ".join(f"'{r}'" for r in run_ids[start : start + _IDS_PER_QUERY])
        try:
            versions = client.search_model_versions(f"run_id IN ({chunk})")
        except MlflowException:
            return {}  # a store without a registry: no run has a version
        for v in versions:
            found.setdefault(v.run_id, []).append((v.name, int(v.version)))
    return {run_id: tuple(f"{n}/{v}" for n, v in sorted(pairs)) for run_id, pairs in found.items()}
