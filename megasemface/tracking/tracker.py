"""What the trainer may call on an experiment tracker, and the tracker that records nothing.

The trainer holds a :class:`Tracker`: :class:`NullTracker` on ranks other than 0 and when
tracking is disabled, :class:`~megasemface.tracking.mlflow_tracker.MLflowTracker` otherwise.
:func:`tracked_run` gives the run a final status that matches how training ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, SupportsFloat

__all__ = [
    "RUN_START_WAIT_S",
    "RUN_STATUSES",
    "NullTracker",
    "RunKilled",
    "RunStatus",
    "Tracker",
    "flatten_params",
    "tracked_run",
]

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
RUN_STATUSES: frozenset[str] = frozenset({"FINISHED", "FAILED", "KILLED"})


class RunKilled(Exception):
    """Raise inside :func:`tracked_run` to end the run KILLED (e.g. after a SIGTERM-driven stop).

    The trainer's signal handler typically sets a flag; the training loop saves a checkpoint,
    then raises ``RunKilled("SIGTERM")``. :func:`tracked_run` re-raises it after ending the run.
    """


RUN_START_WAIT_S = 60.0
"""How long a record that names the run waits for the store to create it: a fresh SQLite
store on a busy machine takes tens of seconds, and a short run would otherwise write its
checkpoints and best model before the run exists, naming none (no lineage, no registration)."""


class Tracker:
    """What the trainer may call on a tracker; every method here is a no-op.

    Implementations must never raise from logging calls and must return quickly: they are
    called from the training loop.
    """

    tracking_uri: str | None = None
    """The store the run is in (None: no store)."""

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

    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str
    ) -> None:
        """Record a dataset the run read (MLflow's dataset input): ``source`` where it lies,
        ``digest`` what identifies its content, ``profile`` its counts, ``context`` its use
        (``training``, ``validation``)."""

    def wait_for_run(self, timeout: float = RUN_START_WAIT_S) -> str | None:
        """:attr:`run_id`, once the store has first answered on the run (waiting at most
        ``timeout`` s): what a record that names the run (a checkpoint, the best model) asks.
        None when tracking is off, the store failed, or the time ran out."""
        return self.run_id

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
