"""The MLflow tracker's worker thread: it makes every MLflow call, so that training never waits.

The training thread hands records over through a bounded queue (:meth:`DeliveryWorker.submit`
never blocks). The worker moves them into an in-memory spool and delivers them in order,
coalescing metrics into ``log_batch`` calls of up to 1000 points. A transient failure keeps the
spool and retries it with exponential backoff; the outage is reported once, its end at INFO.
A refusal (401, 403, 404: the URI, the server's allowed hosts or the credentials are wrong) is
reported at once in one line naming the fix, and retried like an outage. Nothing is dropped
while the store does not answer: past a bound, the oldest metric points go to a spool file in
the run directory (:class:`~megasemface.tracking.disk_spool.DiskSpool`), replayed when the store
answers again; what the run could not deliver when it ended stays there and is replayed at the
next start of the run. A record MLflow rejects for good is dropped with a (rate-limited)
warning.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path

from megasemface.tracking.disk_spool import DiskSpool
from megasemface.tracking.mlflow_names import (
    MAX_METRICS_PER_BATCH,
    describe_error,
    sanitize_name,
)
from megasemface.tracking.mlflow_refusal import refusal_of
from megasemface.tracking.mlflow_run import MLflowRun, Op, is_permanent, now_ms
from megasemface.tracking.system_metrics import SystemMetricsSampler

__all__ = ["DeliveryWorker"]

logger = logging.getLogger(__name__)

_BACKOFF_INITIAL_S = 1.0
_BACKOFF_MAX_S = 60.0
_BACKOFF_WHILE_ENDING_S = 0.5  # end() has a deadline: retry often rather than sleep past it
_DELIVERY_SLICE_S = 0.25  # the worker re-drains its queue at least this often while delivering
_MAX_QUEUED_OPS = 100_000  # the hand-off queue; full only if the worker hangs in one call
_MAX_DROP_WARNINGS = 20


class DeliveryWorker:
    """A daemon thread that creates ``run`` and delivers the records submitted to it.

    Args:
        run: the MLflow run the records go to.
        spool_path: the spool file for what outgrows memory or outlives the process (replayed
            first if an earlier process left one).
        max_spooled_points: at most this many metric points are held in memory while the store
            is unreachable; beyond it the oldest go to ``spool_path``.
        system_metrics: sample system metrics on the worker thread, logged at :attr:`last_step`.
        system_metrics_interval: seconds between samples (None: MLflow's setting or 10).
    """

    def __init__(
        self,
        run: MLflowRun,
        spool_path: Path,
        *,
        max_spooled_points: int,
        system_metrics: bool,
        system_metrics_interval: float | None,
    ) -> None:
        self._run = run
        self._max_spooled_points = max_spooled_points
        self._want_system_metrics = system_metrics
        self._system_interval = system_metrics_interval

        # Caller side.
        self._lock = threading.Lock()
        self._queue: queue.Queue[Op] = queue.Queue(maxsize=_MAX_QUEUED_OPS)
        self._queue_full_dropped = 0
        self.last_step = 0
        """The latest training step logged: system metrics are logged at it."""

        # Worker side (only the worker thread writes these; the caller reads ints for reports).
        self._disabled = False
        self._pending: deque[Op] = deque()
        self._spooled_points = 0
        self._spooled_other = 0
        self._disk = DiskSpool(spool_path)
        self._refusal: str | None = None
        self._drop_warnings = 0
        self._down_since: float | None = None
        self._down_wall: str = ""
        self._warned_outage = False
        self._backoff = _BACKOFF_INITIAL_S
        self._retry_at = 0.0
        self._ending = False
        self.finished = False
        """The run's final status was delivered."""
        self._sampler = SystemMetricsSampler()
        if self._disk.pending():
            logger.info(
                "MLflow tracking: %s holds records an earlier start could not deliver; they "
                "are delivered first",
                self._disk.path,
            )

        self.started = threading.Event()
        """Set once the first attempt to create or reattach the run is over."""
        self._abandon = threading.Event()  # end() timed out: the worker must stop
        self._thread = threading.Thread(target=self._main, name="megasemface-mlflow", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- caller side (any thread)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def outage(self) -> bool:
        """True from the first failed request to the next success."""
        # _down_since is written by the worker; reading a reference is atomic, and being
        # one request late only makes one flush wait or not.
        return self._down_since is not None

    @property
    def dropped_points(self) -> int:
        """Metric points dropped so far: those submitted while the queue was full."""
        return self._queue_full_dropped

    def submit(self, op: Op) -> None:
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
                    self._run.display_uri,
                )

    def submit_marker(self, marker: Op, timeout: float) -> bool:
        """Queue a flush or end marker, waiting up to ``timeout`` s for room; False if none."""
        try:
            self._queue.put(marker, timeout=max(0.0, timeout))
        except queue.Full:
            return False
        return True

    def abandon(self) -> None:
        """Stop the worker after its current call (the run is not being ended in time)."""
        self._abandon.set()

    def report_undelivered(self, status: str, timeout: float) -> None:
        """Summarise, once, what could not be delivered before the run had to end."""
        # Approximate: the worker may still be inside a call; the counts are plain ints.
        points = self._spooled_points + self._disk.points + self.dropped_points
        others = self._spooled_other + self._disk.records + self._queue.qsize()
        since = f" since {self._down_wall}" if self._down_wall else ""
        if self._run.established:
            run, outcome = f"MLflow run {self._run.run_id}", "it stays RUNNING in the store"
        else:
            run, outcome = "The MLflow run", "the run was never created"
        logger.warning(
            "%s at %s could not be ended %s within %.1fs (store unavailable%s): about %d metric "
            "points and %d params/tags/artifact records were not delivered; %s. They are kept "
            "in %s and delivered at the next start of the run in this directory.",
            run,
            self._run.display_uri,
            status,
            timeout,
            since,
            points,
            others,
            outcome,
            self._disk.path,
        )

    # ---------------------------------------------------------------- worker thread

    def _main(self) -> None:
        """Worker loop: take ops from the queue, sample system metrics, deliver with retries."""
        try:
            if self._want_system_metrics:
                self._sampler = SystemMetricsSampler.create(self._system_interval)
            while not self._abandon.is_set() and not self.finished:
                now = time.monotonic()
                self._drain(self._wait_time(now))
                if self._abandon.is_set():
                    break
                now = time.monotonic()
                if now >= self._sampler.next_sample and not self._ending:
                    self._sample_system_metrics(now)
                if now >= self._retry_at and not self._disabled:
                    self._deliver()
                elif self._disabled:
                    self._discard_pending()
        except BaseException:
            logger.exception(
                "MLflow tracking thread crashed; nothing more is logged to %s",
                self._run.display_uri,
            )
        finally:
            self.started.set()
            if not self.finished and not self._disabled:
                self._spill(everything=True)  # the next start of the run delivers it

    def _wait_time(self, now: float) -> float:
        """How long the worker may block on its queue before it has something to do."""
        busy = bool(self._pending) or not self._run.established or self._disk.pending()
        if self._disabled:
            wait = 1.0
        elif busy:
            wait = max(0.0, self._retry_at - now)
        else:
            wait = 5.0
        if not self._ending:
            wait = min(wait, max(0.0, self._sampler.next_sample - now))
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

    def _accept(self, op: Op) -> None:
        self._pending.append(op)
        if op.kind == "metrics":
            self._spooled_points += op.points
        elif op.kind == "end":
            self._ending = True
            # Do not sleep out a long backoff: end() has a deadline.
            self._retry_at = min(self._retry_at, time.monotonic())
            if self._down_since is not None:
                self._spill(everything=True)  # as in _on_failure while ending
        elif op.kind != "flush":
            self._spooled_other += 1

    def _enforce_spool_limit(self) -> None:
        """Move the oldest metric points beyond the bound to the spool file (down to 90%, to
        amortise the scan)."""
        if self._spooled_points > self._max_spooled_points:
            self._spill(everything=False)

    def _spill(self, everything: bool) -> None:
        """Append the oldest metric points past 90% of the bound, or ``everything`` but the
        flush and end markers, to the spool file."""
        excess = self._spooled_points - int(self._max_spooled_points * 0.9)
        kept: deque[Op] = deque()
        spilled: list[Op] = []
        for op in self._pending:
            if op.done is None and (everything or (excess > 0 and op.kind == "metrics")):
                excess -= op.points
                spilled.append(op)
            else:
                kept.append(op)
        if not spilled:
            return
        try:
            self._disk.append(self._run.run_id, spilled)
        except OSError as exc:  # a full or lost disk: keep them in memory, say so once
            if self._drop_warnings == 0:
                self._drop_warnings += 1
                logger.warning("MLflow spool %s cannot be written (%s)", self._disk.path, exc)
            return
        self._pending = kept
        self._spooled_points -= sum(op.points for op in spilled)
        self._spooled_other -= sum(op.kind != "metrics" for op in spilled)

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
            if not self._run.established:
                try:
                    self._run.establish()
                except Exception as exc:
                    if is_permanent(exc):
                        self._disable(exc)
                    else:
                        self._on_failure(exc, "creating the run")
                    return
                finally:
                    self.started.set()
                self._on_success()
            if self._disk.pending():
                if not self._replay():
                    return
                continue
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
                self._run.execute(batch)
            except Exception as exc:
                if not is_permanent(exc):
                    self._on_failure(exc, f"logging {batch[0].kind}")
                    return
                self._warn_dropped(batch, exc)
            for _ in batch:
                self._pop()
            if op.kind == "end":
                self.finished = True
                assert op.done is not None
                op.done.set()
                return
            self._on_success()
            if time.monotonic() >= slice_end:
                return

    def _replay(self) -> bool:
        """Deliver the spool file's next batch; False after a transient failure."""
        run_id, batch, offset = self._disk.read(MAX_METRICS_PER_BATCH)
        if batch:
            try:
                self._run.execute(batch, run_id)
            except Exception as exc:
                if not is_permanent(exc):
                    self._on_failure(exc, f"replaying {batch[0].kind} from {self._disk.path}")
                    return False
                self._warn_dropped(batch, exc)
        self._disk.delivered(offset, batch)
        self._on_success()
        return True

    def _take_batch(self) -> list[Op]:
        """The head op, plus following metrics ops while they fit in one log_batch call."""
        head = self._pending[0]
        batch = [head]
        if head.kind == "metrics":
            total = head.points
            for op in itertools.islice(self._pending, 1, None):
                if op.kind != "metrics" or total + op.points > MAX_METRICS_PER_BATCH:
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
        if self._ending:  # the process may exit before the store answers: the file outlives it
            self._spill(everything=True)
        refusal = refusal_of(exc, self._run.tracking_uri)
        if refusal is not None and refusal != self._refusal:
            # Not an outage: the same request gets the same answer until someone acts.
            self._refusal = refusal
            self._warned_outage = True
            logger.error(
                "MLflow tracking: %s. The run's records are kept (past %d metric points in %s) "
                "and retried.",
                refusal,
                self._max_spooled_points,
                self._disk.path,
            )
            return
        if self._warned_outage:
            logger.debug(
                "MLflow still unavailable (%s); retry in %.1fs", describe_error(exc), delay
            )
            return
        self._warned_outage = True
        logger.warning(
            "MLflow tracking at %s is unavailable (%s while %s). Training continues: metrics, "
            "params, tags and artifacts are kept (in memory up to %d metric points, then in "
            "%s) and retried with backoff (up to every %.0fs); what is still unsent when the "
            "run ends is delivered at its next start. Reported once.",
            self._run.display_uri,
            describe_error(exc),
            what,
            self._max_spooled_points,
            self._disk.path,
            _BACKOFF_MAX_S,
        )

    def _on_success(self) -> None:
        if self._down_since is None:
            return
        logger.info(
            "MLflow tracking at %s is available again after %.0fs; replaying %d spooled "
            "records and %d metric points from %s",
            self._run.display_uri,
            time.monotonic() - self._down_since,
            len(self._pending),
            self._disk.points,
            self._disk.path,
        )
        self._down_since = None
        self._refusal = None
        self._backoff = _BACKOFF_INITIAL_S
        self._retry_at = 0.0

    def _disable(self, exc: BaseException) -> None:
        """The run can never be created (e.g. invalid experiment name): stop trying."""
        self._disabled = True
        logger.error(
            "MLflow tracking at %s disabled: the run cannot be created (%s)",
            self._run.display_uri,
            describe_error(exc),
        )

    def _warn_dropped(self, batch: list[Op], exc: BaseException) -> None:
        """Report a record MLflow rejected for good (rate-limited: bad input may repeat)."""
        self._drop_warnings += 1
        if self._drop_warnings > _MAX_DROP_WARNINGS:
            logger.debug("MLflow rejected %s: %s", batch[0].kind, describe_error(exc))
            return
        points = sum(op.points for op in batch)
        what = f"{points} metric points" if points else batch[0].kind
        logger.warning(
            "MLflow rejected %s for run %s; dropped (%s)%s",
            what,
            self._run.run_id,
            describe_error(exc),
            "; further rejections are logged at DEBUG"
            if self._drop_warnings == _MAX_DROP_WARNINGS
            else "",
        )

    def _sample_system_metrics(self, now: float) -> None:
        """Take one sample of every monitor and spool it as metrics at the latest step."""
        values = self._sampler.sample(now)
        timestamp, step = now_ms(), self.last_step
        points = [
            (sanitize_name(key), float(value), timestamp, step) for key, value in values.items()
        ]
        if points:
            self._accept(Op("metrics", points, points=len(points)))
            self._enforce_spool_limit()
