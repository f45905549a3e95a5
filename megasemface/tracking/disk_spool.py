"""The tracker's records that outgrew memory, or outlived the process, on disk in the run
directory.

One JSON object a line, appended and never rewritten: ``{"run": <run id or null>, "kind":
<record kind>, "payload": ...}``, payloads as the worker's :class:`Op` carries them (metric
points as ``[key, value, timestamp_ms, step]``). ``run`` is the MLflow run the record was logged
for (null: the run did not exist yet; it goes to the run the tracker has when it replays it).
A process that ends before the store answers leaves the file for the next start of the run in
the same directory, which replays it; a line cut short by a crash is skipped and counted.
Plain JSON, never pickle: the file is read back by a later process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megasemface.tracking.mlflow_run import Op

__all__ = ["SPOOL_NAME", "DiskSpool"]

logger = logging.getLogger(__name__)

SPOOL_NAME = "mlflow-spool.jsonl"
"""The file's name in the run's output directory."""


class DiskSpool:
    """Append-only spool file read from a delivered offset; removed once all is delivered.

    Only the tracker's worker thread uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0  # bytes delivered so far
        self.points = 0  # metric points appended by this process and not delivered yet
        self.records = 0  # other records appended by this process and not delivered yet
        self.corrupt_lines = 0
        self._end_cut_line()

    def pending(self) -> bool:
        """Whether the file holds lines not delivered yet (this process's or an earlier's)."""
        try:
            return self.path.stat().st_size > self._offset
        except FileNotFoundError:
            return False

    def append(self, run_id: str | None, ops: list[Op]) -> None:
        """Write ``ops`` (records of ``run_id``), one line each, in one write."""
        text = "".join(
            json.dumps({"run": run_id, "kind": op.kind, "payload": op.payload}) + "\n" for op in ops
        )
        with self.path.open("a", encoding="utf-8") as file:
            file.write(text)
        for op in ops:
            self.points += op.points
            self.records += op.kind != "metrics"

    def read(self, max_points: int) -> tuple[str | None, list[Op], int]:
        """The next batch from the delivered offset: one record, or the metrics lines of one
        run while they hold at most ``max_points`` points; its run id; the offset after it,
        for :meth:`delivered`."""
        ops: list[Op] = []
        run_id: str | None = None
        total = 0
        offset = self._offset
        with self.path.open("rb") as file:
            file.seek(offset)
            for raw in file:
                try:
                    record = json.loads(raw)
                    op = Op(record["kind"], record["payload"])
                    if op.kind == "metrics":
                        op.points = len(op.payload)
                except (ValueError, KeyError, TypeError) as exc:
                    offset += len(raw)
                    self._skip(str(exc))
                    continue
                if ops and (
                    op.kind != "metrics"
                    or ops[0].kind != "metrics"
                    or record["run"] != run_id
                    or total + op.points > max_points
                ):
                    break
                ops.append(op)
                run_id = record["run"]
                total += op.points
                offset += len(raw)
        return run_id, ops, offset

    def delivered(self, offset: int, ops: list[Op]) -> None:
        """Everything before ``offset`` (``ops`` last) is delivered; a fully delivered file is
        removed."""
        self._offset = offset
        self.points = max(0, self.points - sum(op.points for op in ops))
        self.records = max(0, self.records - sum(op.kind != "metrics" for op in ops))
        if not self.pending():
            self.path.unlink(missing_ok=True)
            self._offset = self.points = self.records = 0

    def _end_cut_line(self) -> None:
        """End a line an earlier process was cut off in, so that the lines appended after it
        stay whole (the cut one is skipped when read)."""
        try:
            with self.path.open("rb+") as file:
                if file.seek(0, 2) and (file.seek(-1, 2), file.read(1))[1] != b"\n":
                    file.write(b"\n")
        except FileNotFoundError:
            pass

    def _skip(self, why: str) -> None:
        self.corrupt_lines += 1
        logger.warning("MLflow spool %s: a line is unreadable (%s); skipped", self.path, why)
