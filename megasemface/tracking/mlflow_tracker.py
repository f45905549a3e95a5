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
* **Outages are absorbed.** A call that fails for a transient reason (connection refused,
  timeout, HTTP 5xx, "database is locked", ...) keeps its records in an in-memory spool that is
  retried with exponential backoff and replayed in order when the store is back. Metric points
  in the spool are bounded (``max_spooled_metrics``, oldest dropped first and counted); params,
  tags and artifacts are few and always kept. The outage is reported once with a ``logging``
  warning naming the URI; recovery is logged at INFO; what could not be delivered by
  :meth:`MLflowTracker.end` is summarised once more.
* **Requests that can never succeed are dropped**, not retried (MLflow rejected them, e.g. an
  invalid name), with a warning. Changing an already-logged param (MLflow params are immutable,
  typical after a resume with a new learning rate) keeps the old value, logs the other params and
  warns which keys differ.
* **Run status is always set.** :func:`tracked_run` ends the run FINISHED, FAILED or KILLED; an
  ``atexit`` fallback ends a run the trainer forgot to end (FAILED if the interpreter is exiting
  because of an uncaught exception, KILLED for ``KeyboardInterrupt``, FINISHED otherwise). This
  avoids the runs stuck in RUNNING after crashes that MLflow users commonly complain about.
  Nothing can help after SIGKILL; for SIGTERM (``scancel``, preemption) the trainer should
  install a handler that stops cleanly and raises :class:`RunKilled`, or calls
  ``tracker.end("KILLED")`` itself.
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
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import json
import logging
import os
import posixpath
import queue
import re
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, SupportsFloat
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = [
    "MLflowTracker",
    "NullTracker",
    "RunKilled",
    "RunStatus",
    "Tracker",
    "flatten_params",
    "tracked_run",
]

logger = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
_RUN_STATUSES: frozenset[str] = frozenset({"FINISHED", "FAILED", "KILLED"})

# MLflow's limits (mlflow.utils.validation), copied so that the training thread never needs to
# import mlflow: a value over a limit would make the server reject the whole batch.
_MAX_KEY_LEN = 250
_MAX_PARAM_VALUE_LEN = 6000
_MAX_TAG_VALUE_LEN = 8000
_MAX_PARAMS_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

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

# Defaults for MLflow's REST client in this process (see module docstring).
_HTTP_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

_BACKOFF_INITIAL_S = 1.0
_BACKOFF_MAX_S = 60.0
_BACKOFF_WHILE_ENDING_S = 0.5  # end() has a deadline: retry often rather than sleep past it
_DELIVERY_SLICE_S = 0.25  # the worker re-drains its queue at least this often while delivering
_MAX_QUEUED_OPS = 100_000  # the hand-off queue; full only if the worker hangs in one call
_MAX_DROP_WARNINGS = 20
_TAG_RUN_TOKEN = "megasemface.run_token"

# Portable subset of MLflow's name rule (POSIX servers also accept ':', Windows ones do not).
_INVALID_NAME_CHARS = re.compile(r"[^/\w.\- ]")

_P = ParamSpec("_P")


class RunKilled(Exception):
    """Raise inside :func:`tracked_run` to end the run KILLED (e.g. after a SIGTERM-driven stop).

    The trainer's signal handler typically sets a flag; the training loop saves a checkpoint,
    then raises ``RunKilled("SIGTERM")``. :func:`tracked_run` re-raises it after ending the run.
    """


# --------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------


class Tracker:
    """What the trainer may call on a tracker; every method here is a no-op.

    Implementations must never raise from logging calls and must return quickly: they are
    called from the training loop.
    """

    @property
    def run_id(self) -> str | None:
        """Identifier of the tracked run (store it in checkpoints to reattach), if any."""
        return None

    def log_params(self, params: Mapping[str, Any] | object) -> None:
        """Record hyper-parameters (a mapping or dataclass); nested ones become dotted keys."""

    def log_metrics(self, metrics: Mapping[str, SupportsFloat], step: int) -> None:
        """Record scalar metrics at a training step."""

    def write_events(self, events: Iterable[tuple[str, SupportsFloat, int]]) -> None:
        """Record ``(name, value, step)`` triples (the shape of DeepSpeed's monitor API)."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values are stringified)."""

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload a file or directory into the run's artifacts (under ``artifact_path``)."""

    def log_dict(self, obj: Any, name: str) -> None:
        """Store ``obj`` as a JSON (or YAML, by the extension of ``name``) artifact."""

    @property
    def reachable(self) -> bool:
        """Whether the store answered the last request (a flush is then quick)."""
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what was logged so far reached the store; False on timeout."""
        return True

    def end(self, status: RunStatus = "FINISHED", timeout: float = 10.0) -> None:
        """Deliver what is pending (waiting at most ``timeout`` s) and set the final status."""


class NullTracker(Tracker):
    """Tracker that records nothing: for non-zero ranks and runs with tracking disabled."""


@contextlib.contextmanager
def tracked_run(tracker: Tracker, timeout: float = 10.0) -> Iterator[Tracker]:
    """End ``tracker``'s run with the status matching how the block exits.

    * normal exit, or ``SystemExit`` with code 0/None: FINISHED;
    * :class:`RunKilled` or ``KeyboardInterrupt``: KILLED;
    * any other exception (including a non-zero ``SystemExit``): FAILED.

    Exceptions are always re-raised; ``end`` itself never raises.
    """
    try:
        yield tracker
    except (RunKilled, KeyboardInterrupt):
        tracker.end("KILLED", timeout=timeout)
        raise
    except SystemExit as exc:
        tracker.end("FINISHED" if exc.code in (None, 0) else "FAILED", timeout=timeout)
        raise
    except BaseException:
        tracker.end("FAILED", timeout=timeout)
        raise
    else:
        tracker.end("FINISHED", timeout=timeout)


def flatten_params(params: Mapping[str, Any] | object, prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings (and dataclass instances) into ``{"a.b.c": "value"}``.

    Values are stringified with ``str``; an empty mapping is kept as ``"{}"`` so that its
    existence is visible. Lists and other values are not expanded.
    """
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping or a dataclass instance, not {type(params)}")
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, Mapping):
            if value:
                flat.update(flatten_params(value, prefix=f"{name}."))
            else:
                flat[name] = "{}"
        else:
            flat[name] = str(value)
    return flat


# --------------------------------------------------------------------------------------------
# MLflow implementation
# --------------------------------------------------------------------------------------------

# (key, value, timestamp_ms, step): plain tuples so that the training thread never builds mlflow
# entities (cheap, and no mlflow import on that thread).
_Point = tuple[str, float, int, int]
_OpKind = Literal["metrics", "params", "tags", "artifact", "text", "flush", "end"]


@dataclass(slots=True)
class _Op:
    """One unit of work for the worker, kept in order in its spool until delivered."""

    kind: _OpKind
    payload: Any = None
    points: int = 0  # number of metric points (metrics ops only): the spool is bounded on it
    done: threading.Event | None = None  # set when delivered (flush/end markers)


class _DropOp(Exception):
    """Raised by the worker for a record that can never be delivered (e.g. a missing file)."""


def _never_raise(method: Callable[_P, None]) -> Callable[_P, None]:
    """Make a logging method swallow (and log) its own errors: tracking must not stop training."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.warning("MLflow tracking: %s() failed; ignored", method.__name__, exc_info=True)

    return wrapper


def _sanitize_name(name: str) -> str:
    """Make ``name`` a valid MLflow metric/param/tag key (MLflow treats keys as file paths)."""
    clean = _INVALID_NAME_CHARS.sub("_", str(name))
    parts = ["_" if part in (".", "..") else part for part in clean.split("/") if part]
    clean = "/".join(parts)[:_MAX_KEY_LEN].rstrip("/")
    return clean if clean and posixpath.normpath(clean) == clean else "_"


def _truncate(value: str, limit: int) -> str:
    """Cut ``value`` to ``limit`` characters, ending with '...' to show it was cut."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _redact(uri: str) -> str:
    """Hide credentials (``user:password@``) in a URI before it is logged."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if "@" not in parts.netloc:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _short(exc: BaseException, limit: int = 300) -> str:
    """One-line description of an exception (MLflow's messages embed whole tracebacks)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {_truncate(text, limit)}"


def _is_permanent(exc: BaseException) -> bool:
    """Whether retrying the request that raised ``exc`` is pointless."""
    if isinstance(exc, _DropOp):
        return True
    code = getattr(exc, "error_code", None)  # MlflowException / RestException
    if isinstance(code, str):
        return code in _PERMANENT_ERROR_CODES
    # Programming errors in the payload; OSError and anything unknown count as transient.
    return isinstance(exc, (TypeError, ValueError, LookupError, AttributeError)) and not isinstance(
        exc, OSError
    )


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
        max_spooled_metrics: at most this many metric points are held while the store is
            unreachable; beyond it the oldest are dropped (and counted).
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
        self.tracking_uri, self._artifact_location = self._resolve_store(tracking_uri)
        self._display_uri = _redact(self.tracking_uri)
        if urlsplit(self.tracking_uri).scheme.lower() in ("http", "https"):
            for key, value in _HTTP_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)

        self._experiment = experiment
        self._run_name = run_name
        self._requested_run_id = run_id
        self._run_id: str | None = run_id
        self._tags = {
            _sanitize_name(k): _truncate(str(v), _MAX_TAG_VALUE_LEN)
            for k, v in (tags or {}).items()
        }
        self._want_system_metrics = system_metrics
        self._system_interval = system_metrics_interval
        self._max_spooled_points = max(1, int(max_spooled_metrics))

        # Caller side. `_names` caches sanitised keys: log_metrics stays a dict lookup per key.
        self._lock = threading.Lock()
        self._closed = False
        self._names: dict[str, str] = {}
        self._warned_values: set[str] = set()
        self._queue: queue.Queue[_Op] = queue.Queue(maxsize=_MAX_QUEUED_OPS)
        self._queue_full_dropped = 0
        self._last_step = 0

        # Worker side (only the worker thread writes these; the caller reads ints for reports).
        self._client: MlflowClient | None = None
        self._established = False
        self._disabled = False
        self._pending: deque[_Op] = deque()
        self._spooled_points = 0
        self._spooled_other = 0
        self._dropped_points = 0
        self._drop_warnings = 0
        self._down_since: float | None = None
        self._down_wall: str = ""
        self._warned_outage = False
        self._backoff = _BACKOFF_INITIAL_S
        self._retry_at = 0.0
        self._ending = False
        self._finished = False
        self._create_attempts = 0
        self._run_token = uuid.uuid4().hex
        self._monitors: list[Any] = []
        self._metric_prefix = "system/"
        self._next_sample = float("inf")

        self._started = threading.Event()  # first attempt to create/reattach the run is over
        self._abandon = threading.Event()  # end() timed out: the worker must stop
        self._thread = threading.Thread(
            target=self._worker_main, name="megasemface-mlflow", daemon=True
        )
        self._thread.start()
        atexit.register(self._atexit_end)
        if not self._started.wait(start_timeout):
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
        return self._run_id

    @property
    def reachable(self) -> bool:
        """False during an outage (from the first failed request to the next success), after
        the run ended, or if the worker died."""
        # _down_since is written by the worker; reading a reference is atomic, and being
        # one request late only makes one flush wait or not.
        return not self._closed and self._thread.is_alive() and self._down_since is None

    @_never_raise
    def log_params(self, params: Mapping[str, Any] | object) -> None:
        """Queue params: nested mappings flattened to dotted keys, values stringified and cut to
        MLflow's 6000-character limit (log the full config with :meth:`log_dict`)."""
        if self._closed:
            return
        items = [
            (self._name(key), _truncate(value, _MAX_PARAM_VALUE_LEN))
            for key, value in flatten_params(params).items()
        ]
        for start in range(0, len(items), _MAX_PARAMS_TAGS_PER_BATCH):
            self._put(_Op("params", items[start : start + _MAX_PARAMS_TAGS_PER_BATCH]))

    @_never_raise
    def log_metrics(self, metrics: Mapping[str, SupportsFloat], step: int) -> None:
        """Queue scalar metrics at ``step``. Pass Python numbers: converting a CUDA tensor here
        would synchronise the device (use one ``.item()``/``.tolist()`` for all of them)."""
        if self._closed:
            return
        timestamp = _now_ms()
        step = int(step)
        points = [
            point
            for key, value in metrics.items()
            if (point := self._point(key, value, timestamp, step)) is not None
        ]
        self._last_step = step
        self._put_points(points)

    @_never_raise
    def write_events(self, events: Iterable[tuple[str, SupportsFloat, int]]) -> None:
        """Queue ``(name, value, step)`` triples, as DeepSpeed's ``MonitorMaster.write_events``."""
        if self._closed:
            return
        timestamp = _now_ms()
        points = [
            point
            for key, value, step in events
            if (point := self._point(key, value, timestamp, int(step))) is not None
        ]
        if points:
            self._last_step = max(point[3] for point in points)
        self._put_points(points)

    @_never_raise
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Queue tags; values stringified and cut to MLflow's 8000-character limit."""
        if self._closed:
            return
        items = [(self._name(k), _truncate(str(v), _MAX_TAG_VALUE_LEN)) for k, v in tags.items()]
        for start in range(0, len(items), _MAX_PARAMS_TAGS_PER_BATCH):
            self._put(_Op("tags", items[start : start + _MAX_PARAMS_TAGS_PER_BATCH]))

    @_never_raise
    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Queue the upload of a file or directory. The upload happens later on the worker, so
        the file must stay in place (and unchanged) until :meth:`flush` or :meth:`end`."""
        if self._closed:
            return
        self._put(_Op("artifact", (os.path.abspath(path), artifact_path)))

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
        self._put(_Op("text", (text, name)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` s until everything logged before this call is in the store."""
        if self._closed or not self._thread.is_alive():
            return self._finished
        marker = _Op("flush", done=threading.Event())
        try:
            self._queue.put(marker, timeout=max(0.0, timeout))
        except queue.Full:
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
            if status not in _RUN_STATUSES:
                logger.warning("MLflow tracking: unknown run status %r, using FAILED", status)
                status = "FAILED"
            deadline = time.monotonic() + max(0.0, timeout)
            marker = _Op("end", status, done=threading.Event())
            with contextlib.suppress(queue.Full):  # the worker is stuck: report below
                self._queue.put(marker, timeout=max(0.0, timeout))
            assert marker.done is not None
            if self._thread.is_alive():
                marker.done.wait(max(0.0, deadline - time.monotonic()))
            if not marker.done.is_set():
                self._abandon.set()
                self._report_lost(status, timeout)
            elif self._dropped_points or self._queue_full_dropped:
                logger.warning(
                    "MLflow run %s ended %s; %d metric points were dropped while %s was "
                    "unavailable",
                    self._run_id,
                    status,
                    self._dropped_points + self._queue_full_dropped,
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
            name = _sanitize_name(key)
            if name != key:
                logger.warning(
                    "MLflow tracking: %r is not a valid MLflow name, logged as %r", key, name
                )
            self._names[key] = name
        return name

    def _point(self, key: Any, value: SupportsFloat, timestamp: int, step: int) -> _Point | None:
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

    def _put_points(self, points: list[_Point]) -> None:
        for start in range(0, len(points), _MAX_METRICS_PER_BATCH):
            chunk = points[start : start + _MAX_METRICS_PER_BATCH]
            self._put(_Op("metrics", chunk, points=len(chunk)))

    def _put(self, op: _Op) -> None:
        """Hand ``op`` to the worker without ever blocking the training loop."""
        try:
            self._queue.put_nowait(op)
        except queue.Full:
            with self._lock:
                first = self._queue_full_dropped == 0
                self._queue_full_dropped += max(op.points, 1)
            if first:
                logger.warning(
                    "MLflow tracking thread is stuck (a call to %s has not returned); "
                    "new records are dropped until it recovers",
                    self._display_uri,
                )

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

    def _report_lost(self, status: str, timeout: float) -> None:
        """Summarise, once, what end() could not deliver."""
        # Approximate: the worker may still be inside a call; the counts are plain ints.
        points = self._spooled_points + self._dropped_points + self._queue_full_dropped
        others = self._spooled_other + self._queue.qsize()
        since = f" since {self._down_wall}" if self._down_wall else ""
        if self._established:
            run, outcome = f"MLflow run {self._run_id}", "it stays RUNNING in the store"
        else:
            run, outcome = "The MLflow run", "the run was never created"
        logger.warning(
            "%s at %s could not be ended %s within %.1fs (store unavailable%s): about %d metric "
            "points and %d params/tags/artifact records were not delivered; %s",
            run,
            self._display_uri,
            status,
            timeout,
            since,
            points,
            others,
            outcome,
        )

    # ---------------------------------------------------------------- worker thread

    def _worker_main(self) -> None:
        """Worker loop: take ops from the queue, sample system metrics, deliver with retries."""
        try:
            self._setup_system_metrics()
            while not self._abandon.is_set() and not self._finished:
                now = time.monotonic()
                self._drain(self._wait_time(now))
                if self._abandon.is_set():
                    break
                now = time.monotonic()
                if now >= self._next_sample and not self._ending:
                    self._sample_system_metrics(now)
                if now >= self._retry_at and not self._disabled:
                    self._deliver()
                elif self._disabled:
                    self._discard_pending()
        except BaseException:
            logger.exception(
                "MLflow tracking thread crashed; nothing more is logged to %s", self._display_uri
            )
        finally:
            self._started.set()

    def _wait_time(self, now: float) -> float:
        """How long the worker may block on its queue before it has something to do."""
        busy = bool(self._pending) or not self._established
        if self._disabled:
            wait = 1.0
        elif busy:
            wait = max(0.0, self._retry_at - now)
        else:
            wait = 5.0
        if not self._ending:
            wait = min(wait, max(0.0, self._next_sample - now))
        return wait

    def _drain(self, timeout: float) -> None:
        """Move everything queued into the spool (waiting up to ``timeout`` for the first)."""
        try:
            op = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._accept(op)
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                break
        self._enforce_spool_limit()

    def _accept(self, op: _Op) -> None:
        self._pending.append(op)
        if op.kind == "metrics":
            self._spooled_points += op.points
        elif op.kind == "end":
            self._ending = True
            # Do not sleep out a long backoff: end() has a deadline.
            self._retry_at = min(self._retry_at, time.monotonic())
        elif op.kind != "flush":
            self._spooled_other += 1

    def _enforce_spool_limit(self) -> None:
        """Drop the oldest metric points beyond the bound (down to 90%, to amortise the scan)."""
        if self._spooled_points <= self._max_spooled_points:
            return
        excess = self._spooled_points - int(self._max_spooled_points * 0.9)
        kept: deque[_Op] = deque()
        for op in self._pending:
            if excess > 0 and op.kind == "metrics":
                excess -= op.points
                self._spooled_points -= op.points
                self._dropped_points += op.points
            else:
                kept.append(op)
        self._pending = kept

    def _discard_pending(self) -> None:
        """Tracking is disabled for good: release waiters and forget records."""
        while self._pending:
            op = self._pending.popleft()
            if op.done is not None:
                op.done.set()
        self._spooled_points = self._spooled_other = 0

    def _deliver(self) -> None:
        """Deliver spooled ops in order for one time slice; stop at the first transient error."""
        slice_end = time.monotonic() + _DELIVERY_SLICE_S
        while not self._abandon.is_set():
            if not self._established:
                try:
                    self._establish()
                except Exception as exc:
                    if _is_permanent(exc):
                        self._disable(exc)
                    else:
                        self._on_failure(exc, "creating the run")
                    return
                finally:
                    self._started.set()
                self._on_success()
            if not self._pending:
                return
            op = self._pending[0]
            if op.kind == "flush":
                self._pending.popleft()
                assert op.done is not None
                op.done.set()
                continue
            batch = self._take_batch()
            try:
                self._execute(batch)
            except Exception as exc:
                if not _is_permanent(exc):
                    self._on_failure(exc, f"logging {batch[0].kind}")
                    return
                self._warn_dropped(batch, exc)
            for _ in batch:
                self._pop()
            if op.kind == "end":
                self._finished = True
                assert op.done is not None
                op.done.set()
                return
            self._on_success()
            if time.monotonic() >= slice_end:
                return

    def _take_batch(self) -> list[_Op]:
        """The head op, plus following metrics ops while they fit in one log_batch call."""
        head = self._pending[0]
        batch = [head]
        if head.kind == "metrics":
            total = head.points
            for op in itertools.islice(self._pending, 1, None):
                if op.kind != "metrics" or total + op.points > _MAX_METRICS_PER_BATCH:
                    break
                batch.append(op)
                total += op.points
        return batch

    def _pop(self) -> None:
        op = self._pending.popleft()
        if op.kind == "metrics":
            self._spooled_points -= op.points
        elif op.kind not in ("flush", "end"):
            self._spooled_other -= 1

    def _execute(self, batch: list[_Op]) -> None:
        """Perform one MLflow call for ``batch`` (raises on failure)."""
        from mlflow.entities import Metric, RunTag

        client, run_id = self._client, self._run_id
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
                raise _DropOp(f"{local_path} does not exist (any more)")
        elif head.kind == "text":
            text, name = head.payload
            client.log_text(run_id, text, name)
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
                f"{k}: {_truncate(old, 40)!r} -> {_truncate(val, 40)!r}"
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

    def _establish(self) -> None:
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
            run = client.create_run(
                experiment_id, run_name=self._run_name, tags=self._initial_tags()
            )
        self._run_id = run.info.run_id
        self._established = True
        logger.info(
            "MLflow run %s (%s) in experiment %r at %s",
            run.info.run_id,
            run.info.run_name,
            self._experiment,
            self._display_uri,
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
                self._display_uri,
            )
            return False
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        if self._tags:
            from mlflow.entities import RunTag

            tags = [RunTag(k, v) for k, v in self._tags.items()]
            client.log_batch(run_id, tags=tags, synchronous=True)
        self._run_id = run_id
        self._established = True
        logger.info(
            "MLflow run %s reattached (was %s) at %s", run_id, run.info.status, self._display_uri
        )
        return True

    def _ensure_experiment(self, client: MlflowClient) -> str:
        """Id of the named experiment, created (with our artifact location) or restored."""
        experiment = client.get_experiment_by_name(self._experiment)
        if experiment is None:
            try:
                return client.create_experiment(
                    self._experiment, artifact_location=self._artifact_location
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

    def _on_failure(self, exc: BaseException, what: str) -> None:
        """Schedule a retry with backoff; warn the first time tracking becomes unavailable."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._down_wall = time.strftime("%H:%M:%S")
            self._backoff = _BACKOFF_INITIAL_S
        else:
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
        delay = min(self._backoff, _BACKOFF_WHILE_ENDING_S) if self._ending else self._backoff
        self._retry_at = now + delay
        if self._warned_outage:
            logger.debug("MLflow still unavailable (%s); retry in %.1fs", _short(exc), delay)
            return
        self._warned_outage = True
        logger.warning(
            "MLflow tracking at %s is unavailable (%s while %s). Training continues: metrics, "
            "params, tags and artifacts are kept in memory (at most %d metric points, oldest "
            "dropped first) and retried with backoff (up to every %.0fs); whatever is still "
            "unsent when the run ends or the process exits is lost. Reported once.",
            self._display_uri,
            _short(exc),
            what,
            self._max_spooled_points,
            _BACKOFF_MAX_S,
        )

    def _on_success(self) -> None:
        if self._down_since is None:
            return
        logger.info(
            "MLflow tracking at %s is available again after %.0fs; replaying %d spooled "
            "records (%d metric points dropped meanwhile)",
            self._display_uri,
            time.monotonic() - self._down_since,
            len(self._pending),
            self._dropped_points,
        )
        self._down_since = None
        self._backoff = _BACKOFF_INITIAL_S
        self._retry_at = 0.0

    def _disable(self, exc: BaseException) -> None:
        """The run can never be created (e.g. invalid experiment name): stop trying."""
        self._disabled = True
        logger.error(
            "MLflow tracking at %s disabled: the run cannot be created (%s)",
            self._display_uri,
            _short(exc),
        )

    def _warn_dropped(self, batch: list[_Op], exc: BaseException) -> None:
        """Report a record MLflow rejected for good (rate-limited: bad input may repeat)."""
        self._drop_warnings += 1
        if self._drop_warnings > _MAX_DROP_WARNINGS:
            logger.debug("MLflow rejected %s: %s", batch[0].kind, _short(exc))
            return
        points = sum(op.points for op in batch)
        what = f"{points} metric points" if points else batch[0].kind
        logger.warning(
            "MLflow rejected %s for run %s; dropped (%s)%s",
            what,
            self._run_id,
            _short(exc),
            "; further rejections are logged at DEBUG"
            if self._drop_warnings == _MAX_DROP_WARNINGS
            else "",
        )

    def _setup_system_metrics(self) -> None:
        """Create MLflow's metric monitors (psutil; GPU via nvidia-ml-py or ROCm if present)."""
        if not self._want_system_metrics:
            return
        if importlib.util.find_spec("psutil") is None:
            logger.info("MLflow system metrics disabled: psutil is not installed")
            return
        try:
            from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
            from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
            from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

            monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        except Exception:
            logger.info("MLflow system metrics unavailable", exc_info=True)
            return
        try:
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            monitors.append(GPUMonitor())
        except Exception:
            try:
                from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

                monitors.append(ROCMMonitor())
            except Exception:
                logger.debug("no GPU metrics (nvidia-ml-py / pyrsmi missing or no GPU)")
        interval = self._system_interval
        if interval is None:
            interval = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or 10.0)
        self._system_interval = max(0.1, interval)
        node_id = os.environ.get("MLFLOW_SYSTEM_METRICS_NODE_ID")
        self._metric_prefix = f"system/{node_id}/" if node_id else "system/"
        self._monitors = monitors
        # The first sample after one interval: psutil's CPU percentage needs a previous call.
        for monitor in monitors:
            with contextlib.suppress(Exception):
                monitor.collect_metrics()
                monitor.clear_metrics()
        self._next_sample = time.monotonic() + self._system_interval

    def _sample_system_metrics(self, now: float) -> None:
        """Take one sample of every monitor and spool it as metrics at the latest step."""
        assert self._system_interval is not None
        self._next_sample = now + self._system_interval
        values: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                monitor.collect_metrics()
                values.update(monitor.aggregate_metrics())
            except Exception:
                logger.debug("system metric sampling failed", exc_info=True)
            finally:
                monitor.clear_metrics()
        timestamp, step = _now_ms(), self._last_step
        points = [
            (_sanitize_name(self._metric_prefix + key), float(value), timestamp, step)
            for key, value in values.items()
        ]
        if points:
            self._accept(_Op("metrics", points, points=len(points)))
            self._enforce_spool_limit()
