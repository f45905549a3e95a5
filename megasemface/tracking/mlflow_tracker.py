"""MLflow experiment tracking for the trainer (rank 0 only) that can never stall training.

Usage in the trainer::

    tracker: Tracker = NullTracker()
    if rank == 0 and cfg.tracking.enabled:
        tracker = MLflowTracker(
            tracking_uri=cfg.tracking.uri,          # None: sqlite:///<output_dir>/mlflow.db
            output_dir=output_dir,
            experiment=cfg.tracking.experiment,
            run_name=cfg.run_name,
            run_id=client_state.get("mlflow_run_id"),  # reattach after a restart
        )
    with tracked_run(tracker):                      # FINISHED / FAILED / KILLED
        tracker.log_params(cfg_dict)                # nested dicts -> dotted keys
        tracker.log_dict(cfg_dict, "config.json")   # full config, no truncation
        ...
        tracker.log_metrics({"train/loss": loss, "train/lr": lr}, step=global_step)
        client_state["mlflow_run_id"] = tracker.run_id   # store in every checkpoint

Design:

* **One background thread does every MLflow call.** ``log_*`` only converts its arguments to
  plain tuples, puts them on a queue and returns (microseconds). The worker coalesces metrics
  into ``MlflowClient.log_batch`` calls of up to 1000 points.
* **Outages lose nothing.** A call that fails for a transient reason (connection refused,
  timeout, HTTP 5xx, "database is locked", ...) keeps its records in a spool that is retried
  with exponential backoff and replayed when the store is back. Past ``max_spooled_metrics``
  points in memory, the oldest go to ``<output_dir>/mlflow-spool.jsonl`` (JSON lines); what
  :meth:`MLflowTracker.end` could not deliver goes there too, and the next tracker started on
  the same output directory (the run's resume) delivers it first. The outage is reported once
  with a ``logging`` warning naming the URI; recovery is logged at INFO; what could not be
  delivered by :meth:`MLflowTracker.end` is summarised once more.
* **Refusals are reported at once.** A server that answers 401, 403 or 404 (credentials, a host
  name missing from its ``--allowed-hosts``, a wrong path) refuses every retry too: one error
  line names the fix; the records are kept and retried as in an outage.
* **Requests that can never succeed are dropped**, not retried (MLflow rejected them, e.g. an
  invalid name), with a warning. Changing an already-logged param (MLflow params are immutable,
  typical after a resume with a new learning rate) keeps the old value, logs the other params and
  warns which keys differ.
* **Run status is always set.** :func:`~megasemface.tracking.tracker.tracked_run` ends the run
  FINISHED, FAILED or KILLED; an ``atexit`` fallback ends a run the trainer forgot to end (FAILED
  if the interpreter is exiting because of an uncaught exception, KILLED for
  ``KeyboardInterrupt``, FINISHED otherwise). This avoids the runs stuck in RUNNING after crashes
  that MLflow users commonly complain about. Nothing can help after SIGKILL; for SIGTERM
  (``scancel``, preemption) the trainer should install a handler that stops cleanly and raises
  :class:`~megasemface.tracking.tracker.RunKilled`, or calls ``tracker.end("KILLED")`` itself.
* **Storage.** Without a URI (and without ``MLFLOW_TRACKING_URI``) runs go to
  ``sqlite:///<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts``: MLflow's
  file store is deprecated (it raises unless ``MLFLOW_ALLOW_FILE_STORE=true`` since 3.13) and
  SQLite's default artifact root would be ``./mlruns`` in whatever the current directory is.
  Browse with ``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``. SQLite allows
  one writer at a time: concurrent jobs sharing a database should use an ``mlflow server``
  instead ("database is locked" errors are retried here, but they slow delivery).
* **HTTP retries.** MLflow's REST client retries a failed request 7 times with exponential
  backoff (minutes) and waits up to 120 s per request. Those settings are read from the process
  environment at every request, with no per-client override, so for ``http(s)://`` URIs this
  module sets ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT=10`` in
  ``os.environ`` *unless the user has set them*; the tracker does its own retrying. This affects
  other MLflow clients in the same process too, which in a training process is desired.
* **System metrics** (CPU, memory, disk, network; GPU with ``nvidia-ml-py``) are sampled with
  MLflow's own monitor classes on the worker thread every
  ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` seconds (default 10) and logged as
  ``system/<name>`` (``system/<node_id>/<name>`` with ``MLFLOW_SYSTEM_METRICS_NODE_ID``) at
  the latest training step given to :meth:`~MLflowTracker.log_metrics`, so that they line up
  with the training curves and continue after a resume. MLflow's ``log_system_metrics=True``
  is not used: its monitor thread makes its own MLflow calls, bypasses the spool and stops for
  good at the first failed request. Without ``psutil`` system metrics are skipped.

The worker thread is :class:`~megasemface.tracking.mlflow_delivery.DeliveryWorker`, the MLflow
requests it makes are :class:`~megasemface.tracking.mlflow_run.MLflowRun`'s and the samples
:class:`~megasemface.tracking.system_metrics.SystemMetricsSampler`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, SupportsFloat
from urllib.parse import urlsplit

from megasemface.tracking.disk_spool import SPOOL_NAME
from megasemface.tracking.mlflow_delivery import DeliveryWorker
from megasemface.tracking.mlflow_names import (
    MAX_DIGEST_LEN,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE_LEN,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VALUE_LEN,
    redact_uri,
    sanitize_name,
    truncate,
)
from megasemface.tracking.mlflow_run import MLflowRun, Op, Point, now_ms
from megasemface.tracking.tracker import (
    RUN_START_WAIT_S,
    RUN_STATUSES,
    RunStatus,
    Tracker,
    flatten_params,
)

__all__ = ["MLflowTracker"]

logger = logging.getLogger(__name__)

# Defaults for MLflow's REST client in this process (see module docstring).
_HTTP_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

_P = ParamSpec("_P")


def _never_raise(method: Callable[_P, None]) -> Callable[_P, None]:
    """Make a logging method swallow (and log) its own errors: tracking must not stop training."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.warning("MLflow tracking: %s() failed; ignored", method.__name__, exc_info=True)

    return wrapper


class MLflowTracker(Tracker):
    """Asynchronous, outage-tolerant MLflow run for the trainer's rank 0.

    Args:
        tracking_uri: MLflow tracking URI. None: ``MLFLOW_TRACKING_URI`` if set, otherwise
            ``sqlite:///<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts``.
            For another ``sqlite:///`` URI, artifacts of newly created experiments go to
            ``mlartifacts`` next to the database file.
        output_dir: the training output directory (created if missing).
        experiment: experiment name (created if missing, restored if deleted). Ignored when
            reattaching to ``run_id``.
        run_name: display name of a new run (MLflow picks one when None).
        run_id: reattach to this run (resume after a restart) and mark it RUNNING again. If the
            store does not know it, a warning is logged and a new run is created.
        tags: tags for the run (set again on reattach).
        system_metrics: sample CPU/memory/disk/network/GPU metrics (needs ``psutil``).
        start_timeout: how long the constructor waits for the run to be created or reattached.
            Creating a fresh SQLite database takes a few seconds (schema migrations). If the
            store is unreachable the constructor returns after the first failed attempt and
            :attr:`run_id` stays None until the store comes back.
        max_spooled_metrics: at most this many metric points are held in memory while the store
            is unreachable; beyond it the oldest go to the spool file in ``output_dir``.
        system_metrics_interval: seconds between system-metric samples; None:
            ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` or 10.

    Raises:
        ImportError: if ``mlflow`` is not installed (a configuration error worth failing on
            before training starts).
    """

    def __init__(
        self,
        tracking_uri: str | None,
        output_dir: str | os.PathLike[str],
        experiment: str,
        run_name: str | None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        system_metrics: bool = True,
        *,
        start_timeout: float = 15.0,
        max_spooled_metrics: int = 100_000,
        system_metrics_interval: float | None = None,
    ) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError(
                "MLflowTracker needs the 'mlflow' (or 'mlflow-skinny') package: "
                "pip install mlflow, or disable tracking"
            )
        # abspath, not resolve(): keep the user's symlinks (e.g. a scratch link to a shared disk).
        self._output_dir = Path(os.path.abspath(output_dir))
        self._output_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri, artifact_location = self._resolve_store(tracking_uri)
        self._display_uri = redact_uri(self.tracking_uri)
        if urlsplit(self.tracking_uri).scheme.lower() in ("http", "https"):
            for key, value in _HTTP_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        self._run = MLflowRun(
            self.tracking_uri,
            artifact_location,
            self._display_uri,
            experiment,
            run_name,
            run_id,
            {
                sanitize_name(k): truncate(str(v), MAX_TAG_VALUE_LEN)
                for k, v in (tags or {}).items()
            },
        )

        # `_names` caches sanitised keys: log_metrics stays a dict lookup per key.
        self._lock = threading.Lock()
        self._closed = False
        self._names: dict[str, str] = {}
        self._warned_values: set[str] = set()
        self._worker = DeliveryWorker(
            self._run,
            self._output_dir / SPOOL_NAME,
            max_spooled_points=max(1, int(max_spooled_metrics)),
            system_metrics=system_metrics,
            system_metrics_interval=system_metrics_interval,
        )
        atexit.register(self._atexit_end)
        if not self._worker.started.wait(start_timeout):
            logger.info(
                "MLflow run at %s is not ready after %.0fs; continuing, it is created in the "
                "background",
                self._display_uri,
                start_timeout,
            )

    # ---------------------------------------------------------------- public API (any thread)

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the run exists (or the id being reattached to)."""
        return self._run.run_id

    def wait_for_run(self, timeout: float = RUN_START_WAIT_S) -> str | None:
        """:attr:`run_id` after the worker's first attempt to create or reattach the run,
        waiting at most ``timeout`` s for it (at once when it was made already, or failed)."""
        if not self._closed and self._worker.is_alive():
            self._worker.started.wait(max(0.0, timeout))
        return self.run_id

    @property
    def reachable(self) -> bool:
        """False during an outage (from the first failed request to the next success), after
        the run ended, or if the worker died."""
        return not self._closed and self._worker.is_alive() and not self._worker.outage

    @_never_raise
    def log_params(self, params: Mapping[str, Any] | object) -> None:
        """Queue params: nested mappings flattened to dotted keys, values stringified and cut to
        MLflow's 6000-character limit (log the full config with :meth:`log_dict`)."""
        if self._closed:
            return
        items = [
            (self._name(key), truncate(value, MAX_PARAM_VALUE_LEN))
            for key, value in flatten_params(params).items()
        ]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._worker.submit(Op("params", items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    @_never_raise
    def log_metrics(self, metrics: Mapping[str, SupportsFloat], step: int) -> None:
        """Queue scalar metrics at ``step``. Pass Python numbers: converting a CUDA tensor here
        would synchronise the device (use one ``.item()``/``.tolist()`` for all of them)."""
        if self._closed:
            return
        timestamp = now_ms()
        step = int(step)
        points = [
            point
            for key, value in metrics.items()
            if (point := self._point(key, value, timestamp, step)) is not None
        ]
        self._worker.last_step = step
        self._put_points(points)

    @_never_raise
    def write_events(self, events: Iterable[tuple[str, SupportsFloat, int]]) -> None:
        """Queue ``(name, value, step)`` triples, as DeepSpeed's ``MonitorMaster.write_events``."""
        if self._closed:
            return
        timestamp = now_ms()
        points = [
            point
            for key, value, step in events
            if (point := self._point(key, value, timestamp, int(step))) is not None
        ]
        if points:
            self._worker.last_step = max(point[3] for point in points)
        self._put_points(points)

    @_never_raise
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Queue tags; values stringified and cut to MLflow's 8000-character limit."""
        if self._closed:
            return
        items = [(self._name(k), truncate(str(v), MAX_TAG_VALUE_LEN)) for k, v in tags.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._worker.submit(Op("tags", items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    @_never_raise
    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Queue the upload of a file or directory. The upload happens later on the worker, so
        the file must stay in place (and unchanged) until :meth:`flush` or :meth:`end`."""
        if self._closed:
            return
        self._worker.submit(Op("artifact", (os.path.abspath(path), artifact_path)))

    @_never_raise
    def log_dict(self, obj: Any, name: str) -> None:
        """Queue ``obj`` as a JSON artifact (YAML if ``name`` ends in .yaml/.yml). It is
        serialised now, so later changes to ``obj`` do not matter; unknown types become str."""
        if self._closed:
            return
        if name.lower().endswith((".yaml", ".yml")):
            import yaml  # a dependency of mlflow

            # The JSON round trip turns Paths, enums, ... into strings that safe_dump accepts.
            plain = json.loads(json.dumps(obj, default=str))
            text = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)
        else:
            text = json.dumps(obj, indent=2, default=str)
        self._worker.submit(Op("text", (text, name)))

    @_never_raise
    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str
    ) -> None:
        """Queue a dataset input: shown in the UI's Dataset column and on the run's page."""
        if self._closed:
            return
        dataset = {
            "name": name,
            "digest": digest[:MAX_DIGEST_LEN],
            "source_type": "local",
            "source": json.dumps({"uri": source}),
            "profile": json.dumps(profile),
        }
        self._worker.submit(Op("dataset", (dataset, context)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` s until everything logged before this call is in the store."""
        if self._closed or not self._worker.is_alive():
            return self._worker.finished
        marker = Op("flush", done=threading.Event())
        if not self._worker.submit_marker(marker, timeout):
            return False
        assert marker.done is not None
        return marker.done.wait(timeout)

    def end(self, status: RunStatus = "FINISHED", timeout: float = 10.0) -> None:
        """Deliver pending records within ``timeout`` s, then set the run's final status.

        Never raises. Later calls (and later ``log_*`` calls) are ignored. If the store cannot
        be reached in time, what is lost is reported and the run stays RUNNING in the store.
        """
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            with contextlib.suppress(Exception):
                atexit.unregister(self._atexit_end)
            if status not in RUN_STATUSES:
                logger.warning("MLflow tracking: unknown run status %r, using FAILED", status)
                status = "FAILED"
            deadline = time.monotonic() + max(0.0, timeout)
            marker = Op("end", status, done=threading.Event())
            # If the worker is stuck the marker finds no room: what is lost is reported below.
            self._worker.submit_marker(marker, timeout)
            assert marker.done is not None
            if self._worker.is_alive():
                marker.done.wait(max(0.0, deadline - time.monotonic()))
            if not marker.done.is_set():
                self._worker.abandon()
                self._worker.report_undelivered(status, timeout)
            elif self._worker.dropped_points:
                logger.warning(
                    "MLflow run %s ended %s; %d metric points were dropped while a call to %s "
                    "did not return",
                    self._run.run_id,
                    status,
                    self._worker.dropped_points,
                    self._display_uri,
                )
        except Exception:
            logger.warning("MLflow tracking: end() failed; ignored", exc_info=True)

    # ---------------------------------------------------------------- caller-side helpers

    def _resolve_store(self, tracking_uri: str | None) -> tuple[str, str | None]:
        """Pick the tracking URI and, for local SQLite stores, where artifacts should go."""
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:
            db = self._output_dir / "mlflow.db"
            return f"sqlite:///{db}", (self._output_dir / "mlartifacts").as_uri()
        prefix = "sqlite:///"
        path, sep, query = uri[len(prefix) :].partition("?")  # e.g. ?timeout=30
        if uri.startswith(prefix) and path and path != ":memory:":
            # Absolute path: a relative one would follow the process's current directory.
            db = Path(os.path.abspath(path))
            return f"{prefix}{db}{sep}{query}", (db.parent / "mlartifacts").as_uri()
        return uri, None

    def _name(self, key: Any) -> str:
        """Cached, sanitised metric/param/tag name; warns once per renamed key."""
        key = str(key)
        name = self._names.get(key)
        if name is None:
            name = sanitize_name(key)
            if name != key:
                logger.warning(
                    "MLflow tracking: %r is not a valid MLflow name, logged as %r", key, name
                )
            self._names[key] = name
        return name

    def _point(self, key: Any, value: SupportsFloat, timestamp: int, step: int) -> Point | None:
        """Convert one metric to a queue tuple, or warn once per key and skip it."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            if key not in self._warned_values:
                self._warned_values.add(key)
                logger.warning(
                    "MLflow tracking: metric %r has non-numeric value %r; skipped", key, value
                )
            return None
        return (self._name(key), number, timestamp, step)

    def _put_points(self, points: list[Point]) -> None:
        for start in range(0, len(points), MAX_METRICS_PER_BATCH):
            chunk = points[start : start + MAX_METRICS_PER_BATCH]
            self._worker.submit(Op("metrics", chunk, points=len(chunk)))

    def _atexit_end(self) -> None:
        """End a run the trainer did not end, with a status guessed from how Python exits."""
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is None:
            status: RunStatus = "FINISHED"
        elif isinstance(exc, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self.end(status, timeout=5.0)
