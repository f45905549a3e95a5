"""The MLflow run the tracker writes to: creating or reattaching it, and one request per batch.

Everything here runs on the tracker's worker thread and raises on failure; whether a failure is
retried is decided by :func:`is_permanent`. The records handed over are plain tuples, built on
the training thread without importing mlflow.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megasemface.tracking.mlflow_names import PARENT_TAG, truncate

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["DropOp", "MLflowRun", "Op", "OpKind", "Point", "is_permanent", "now_ms"]

logger = logging.getLogger(__name__)

# (key, value, timestamp_ms, step): plain tuples so that the training thread never builds mlflow
# entities (cheap, and no mlflow import on that thread).
Point = tuple[str, float, int, int]
OpKind = Literal["metrics", "params", "tags", "artifact", "text", "dataset", "flush", "end"]


def now_ms() -> int:
    """The wall-clock time of a :data:`Point`."""
    return int(time.time() * 1000)


# Error codes for requests that will fail again however often they are retried.
# Everything else (connection errors, timeouts, INTERNAL_ERROR, TEMPORARILY_UNAVAILABLE such as
# SQLite's "database is locked", auth errors a token refresh may fix) is treated as transient.
_PERMANENT_ERROR_CODES = frozenset(
    {
        "INVALID_PARAMETER_VALUE",
        "BAD_REQUEST",
        "MALFORMED_REQUEST",
        "RESOURCE_DOES_NOT_EXIST",
        "RESOURCE_ALREADY_EXISTS",
        "INVALID_STATE",
    }
)

_TAG_RUN_TOKEN = "megasemface.run_token"
_TAG_NOTE = "mlflow.note.content"  # the run's description, markdown, on its page in the UI
_TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
# MLflow 3's UI opens an experiment without this tag on its GenAI overview (traces, prompts);
# this kind opens it on its training runs.
_EXPERIMENT_KIND = "custom_model_development"


@dataclass(slots=True)
class Op:
    """One unit of work for the worker, kept in order in its spool until delivered."""

    kind: OpKind
    payload: Any = None
    points: int = 0  # number of metric points (metrics ops only): the spool is bounded on it
    done: threading.Event | None = None  # set when delivered (flush/end markers)


class DropOp(Exception):
    """Raised by the worker for a record that can never be delivered (e.g. a missing file)."""


def is_permanent(exc: BaseException) -> bool:
    """Whether retrying the request that raised ``exc`` is pointless."""
    if isinstance(exc, DropOp):
        return True
    code = getattr(exc, "error_code", None)  # MlflowException / RestException
    if isinstance(code, str):
        return code in _PERMANENT_ERROR_CODES
    # Programming errors in the payload; OSError and anything unknown count as transient.
    return isinstance(exc, (TypeError, ValueError, LookupError, AttributeError)) and not isinstance(
        exc, OSError
    )


class MLflowRun:
    """A run in an MLflow store: created (or reattached to ``run_id``) by :meth:`establish`.

    Args:
        tracking_uri: the store's URI.
        artifact_location: artifact root for an experiment created here (None: MLflow's).
        display_uri: ``tracking_uri`` as it may be logged (credentials hidden).
        experiment: experiment name (created if missing, restored if deleted).
        run_name: display name of a new run (MLflow picks one when None).
        run_id: reattach to this run if the store knows it.
        tags: sanitised tags for the run (set again on reattach).
    """

    def __init__(
        self,
        tracking_uri: str,
        artifact_location: str | None,
        display_uri: str,
        experiment: str,
        run_name: str | None,
        run_id: str | None,
        tags: Mapping[str, str],
    ) -> None:
        self.tracking_uri = tracking_uri
        self.display_uri = display_uri
        self._artifact_location = artifact_location
        self._experiment = experiment
        self._run_name = run_name
        self._requested_run_id = run_id
        self.run_id: str | None = run_id
        self._tags = dict(tags)
        self.established = False
        self._client: MlflowClient | None = None
        self._create_attempts = 0
        self._run_token = uuid.uuid4().hex

    def establish(self) -> None:
        """Create the client and the run (or reattach to ``run_id``); raises on failure."""
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        client = self._client
        if self._requested_run_id is not None:
            if self._reattach(client, self._requested_run_id):
                return
            self._requested_run_id = None  # unknown here: fall through to a new run
        experiment_id = self._ensure_experiment(client)
        run = None
        if self._create_attempts:
            # An earlier create_run may have succeeded although its reply was lost (timeout):
            # find it by our token rather than leaving an orphan RUNNING run behind.
            found = client.search_runs(
                [experiment_id],
                filter_string=f"tags.`{_TAG_RUN_TOKEN}` = '{self._run_token}'",
                max_results=1,
            )
            run = found[0] if found else None
        if run is None:
            self._create_attempts += 1
            tags = self._initial_tags()
            tags.update(self._lineage_tags(client, tags))
            run = client.create_run(experiment_id, run_name=self._run_name, tags=tags)
        self.run_id = run.info.run_id
        self.established = True
        logger.info(
            "MLflow run %s (%s) in experiment %r at %s",
            run.info.run_id,
            run.info.run_name,
            self._experiment,
            self.display_uri,
        )

    def execute(self, batch: list[Op], run_id: str | None = None) -> None:
        """Perform one MLflow call for ``batch`` in ``run_id`` (None: this run); raises on
        failure."""
        from mlflow.entities import Metric, RunTag

        client, run_id = self._client, run_id or self.run_id
        assert client is not None and run_id is not None
        head = batch[0]
        if head.kind == "metrics":
            metrics = [
                Metric(key, value, timestamp, step)
                for op in batch
                for key, value, timestamp, step in op.payload
            ]
            client.log_batch(run_id, metrics=metrics, synchronous=True)
        elif head.kind == "params":
            self._log_params_batch(client, run_id, head.payload)
        elif head.kind == "tags":
            tags = [RunTag(key, value) for key, value in head.payload]
            client.log_batch(run_id, tags=tags, synchronous=True)
        elif head.kind == "artifact":
            local_path, artifact_path = head.payload
            path = Path(local_path)
            if path.is_dir():
                client.log_artifacts(run_id, local_path, artifact_path)
            elif path.is_file():
                client.log_artifact(run_id, local_path, artifact_path)
            else:
                raise DropOp(f"{local_path} does not exist (any more)")
        elif head.kind == "text":
            text, name = head.payload
            client.log_text(run_id, text, name)
        elif head.kind == "dataset":
            from mlflow.entities import Dataset, DatasetInput, InputTag

            dataset, context = head.payload
            tags = [InputTag("mlflow.data.context", context)]
            client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**dataset), tags)])
        elif head.kind == "end":
            client.set_terminated(run_id, status=head.payload)

    def _log_params_batch(
        self, client: MlflowClient, run_id: str, items: list[tuple[str, str]]
    ) -> None:
        """Log params; on a conflict with already-logged values keep the old ones and warn.

        MLflow params are immutable and one changed value makes the whole batch fail, which is
        typical after a resume with a modified config.
        """
        from mlflow.entities import Param

        try:
            client.log_batch(run_id, params=[Param(k, v) for k, v in items], synchronous=True)
            return
        except Exception as exc:
            if getattr(exc, "error_code", None) != "INVALID_PARAMETER_VALUE":
                raise
        existing = client.get_run(run_id).data.params
        changed = {k: (existing[k], v) for k, v in items if k in existing and existing[k] != v}
        new = [Param(k, v) for k, v in items if k not in existing]
        if new:
            client.log_batch(run_id, params=new, synchronous=True)
        if changed:
            shown = ", ".join(
                f"{k}: {truncate(old, 40)!r} -> {truncate(val, 40)!r}"
                for k, (old, val) in list(changed.items())[:10]
            )
            logger.warning(
                "MLflow run %s already has different values for %d params, which MLflow does "
                "not allow to change; they keep their old values (%s%s). Log changed settings "
                "as tags or in a config artifact instead.",
                run_id,
                len(changed),
                shown,
                ", ..." if len(changed) > 10 else "",
            )

    def _reattach(self, client: MlflowClient, run_id: str) -> bool:
        """Mark ``run_id`` RUNNING again; False if the store does not know the run."""
        try:
            run = client.get_run(run_id)
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
            logger.warning(
                "MLflow run %s does not exist at %s; starting a new run instead",
                run_id,
                self.display_uri,
            )
            return False
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        if self._tags:
            from mlflow.entities import RunTag

            tags = [RunTag(k, v) for k, v in self._tags.items()]
            client.log_batch(run_id, tags=tags, synchronous=True)
        self.run_id = run_id
        self.established = True
        logger.info(
            "MLflow run %s reattached (was %s) at %s", run_id, run.info.status, self.display_uri
        )
        return True

    def _ensure_experiment(self, client: MlflowClient) -> str:
        """Id of the named experiment, created (with our artifact location) or restored."""
        experiment = client.get_experiment_by_name(self._experiment)
        if experiment is None:
            try:
                return client.create_experiment(
                    self._experiment,
                    artifact_location=self._artifact_location,
                    tags={_TAG_EXPERIMENT_KIND: _EXPERIMENT_KIND},
                )
            except Exception as exc:
                # Another job created it between our lookup and create_experiment.
                if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = client.get_experiment_by_name(self._experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
            logger.info("MLflow experiment %r was deleted; restored it", self._experiment)
        if _TAG_EXPERIMENT_KIND not in experiment.tags:  # made by an older version or by hand
            client.set_experiment_tag(
                experiment.experiment_id, _TAG_EXPERIMENT_KIND, _EXPERIMENT_KIND
            )
        return experiment.experiment_id

    def _initial_tags(self) -> dict[str, str]:
        """User tags plus MLflow's context tags (user, source, git commit) and our token."""
        tags = dict(self._tags)
        try:
            from mlflow.tracking.context.registry import resolve_tags

            tags = {str(k): str(v) for k, v in resolve_tags(tags).items()}
        except Exception:
            logger.debug("MLflow context tags unavailable", exc_info=True)
        tags[_TAG_RUN_TOKEN] = self._run_token
        return tags

    def _lineage_tags(self, client: MlflowClient, tags: Mapping[str, str]) -> dict[str, str]:
        """For every ``parent_<role>_run`` tag (a run id), ``parent_<role>_run_name`` and a
        description with links to the parent runs, so the UI names and links them."""
        lines: dict[str, list[str]] = {}
        found: dict[str, str] = {}
        for key, run_id in sorted(tags.items()):
            match = PARENT_TAG.match(key)
            if not match or not run_id:
                continue
            try:
                parent = client.get_run(run_id)
            except Exception:  # another store, or deleted: the id tag stays, without a name
                logger.debug("parent run %s not found", run_id, exc_info=True)
                continue
            name = parent.info.run_name or run_id
            found[f"{key}_name"] = name
            link = f"[{name}](#/experiments/{parent.info.experiment_id}/runs/{run_id})"
            lines.setdefault(link, []).append(match.group(1))
        if lines and _TAG_NOTE not in tags:
            parents = "; ".join(f"{link} ({', '.join(roles)})" for link, roles in lines.items())
            found[_TAG_NOTE] = f"Made from: {parents}."
        return found
