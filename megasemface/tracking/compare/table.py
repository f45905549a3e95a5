"""Table columns and formatting: column specs, cell values and the text, Markdown and CSV tables.

Part of :mod:`megasemface.tracking.compare`, which re-exports the public names.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from megasemface.tracking.compare.runs import (
    CompareError,
    MetricAgg,
    RunRecord,
    format_lineage,
    metric_value,
)

__all__ = [
    "DEFAULT_COLUMNS",
    "Column",
    "TableFormat",
    "format_table",
    "parse_column",
]

TableFormat = Literal["table", "markdown", "csv"]

DEFAULT_COLUMNS: tuple[str, ...] = (
    "name",
    "tags.system",
    "tags.stage",
    "tags.interface",
    "tags.direction",
    "metrics.loss",
    "metrics.valid_bleu",
    "metrics.test_bleu",
    "metrics.test_chrf",
    "registered",
    "status",
    "duration",
    "lineage",
)

_ATTRIBUTES: dict[str, str] = {
    "name": "run",
    "run_id": "run_id",
    "experiment": "experiment",
    "status": "status",
    "start": "start",
    "duration": "duration",
    "lineage": "lineage",
    "registered": "registered",
}
_PREFIXES: dict[str, Literal["tag", "param", "metric"]] = {
    "tags.": "tag",
    "params.": "param",
    "metrics.": "metric",
}
_MISSING = "-"


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: a run attribute, or a tag, param or metric by key."""

    kind: Literal["attribute", "tag", "param", "metric"]
    key: str

    @property
    def spec(self) -> str:
        """The column as written in a column list (``tags.system``, ``duration``)."""
        return self.key if self.kind == "attribute" else f"{self.kind}s.{self.key}"

    def header(self, metric_agg: MetricAgg = "last") -> str:
        """Column title: the key alone (``system``, ``test_bleu (max)``)."""
        if self.kind == "attribute":
            return _ATTRIBUTES[self.key]
        if self.kind == "metric" and metric_agg != "last":
            return f"{self.key} ({metric_agg})"
        return self.key


def parse_column(spec: str | Column) -> Column:
    """``"tags.system"``, ``"params.train.preset"``, ``"metrics.loss"`` or an attribute name."""
    if isinstance(spec, Column):
        return spec
    text = spec.strip()
    if text in _ATTRIBUTES:
        return Column("attribute", text)
    for prefix, kind in _PREFIXES.items():
        if text.startswith(prefix) and len(text) > len(prefix):
            return Column(kind, text[len(prefix) :])
    raise CompareError(
        f"unknown column {spec!r}: use tags.<key>, params.<key>, metrics.<key> or one of "
        f"{', '.join(_ATTRIBUTES)}"
    )


def _cell(record: RunRecord, column: Column, agg: MetricAgg) -> str | float | None:
    """The raw value of one cell; None where the run has none."""
    if column.kind == "tag":
        return record.tags.get(column.key) or None
    if column.kind == "param":
        return record.params.get(column.key)
    if column.kind == "metric":
        return metric_value(record, column.key, agg)
    if column.key == "name":
        return record.name
    if column.key == "run_id":
        return record.run_id
    if column.key == "experiment":
        return record.experiment
    if column.key == "status":
        return record.status
    if column.key == "duration":
        return record.duration_s
    if column.key == "start":
        return None if record.start_time_ms is None else _iso(record.start_time_ms)
    if column.key == "registered":
        return ", ".join(record.registered) or None
    return format_lineage(record.lineage) or None


def _iso(ms: int) -> str:
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _human_duration(seconds: float) -> str:
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _human_number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def _render(value: str | float | None, column: Column, fmt: TableFormat) -> str:
    if value is None:
        return "" if fmt == "csv" else _MISSING
    if isinstance(value, str):
        return value
    if fmt == "csv":
        # Full precision: the CSV is for reading back, not for eyes.
        return repr(round(value, 3)) if column.key == "duration" else repr(value)
    if column.kind == "attribute" and column.key == "duration":
        return _human_duration(value)
    return _human_number(value)


def format_table(
    records: Sequence[RunRecord],
    columns: Sequence[str | Column] = DEFAULT_COLUMNS,
    fmt: TableFormat = "table",
    *,
    metric_agg: MetricAgg = "last",
) -> str:
    """The runs as a table: aligned plain text, a Markdown table or CSV (with a header row).

    Missing values are ``-`` in text and Markdown and empty in CSV. CSV numbers keep full
    precision (durations in seconds, start times in ISO 8601 UTC).
    """
    if fmt not in get_args(TableFormat):
        raise CompareError(f"unknown table format {fmt!r}; use one of table, markdown, csv")
    cols = [parse_column(c) for c in columns]
    if not cols:
        raise CompareError("no columns to show")
    raw = [[_cell(r, c, metric_agg) for c in cols] for r in records]
    headers = [c.header(metric_agg) for c in cols]
    rows = [[_render(v, c, fmt) for v, c in zip(row, cols, strict=True)] for row in raw]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows(rows)
        return out.getvalue()
    # Numbers are right-aligned: a column of numbers (and blanks) reads by magnitude.
    numeric = [
        any(isinstance(row[i], float | int) for row in raw)
        and all(v is None or isinstance(v, float | int) for v in (row[i] for row in raw))
        for i in range(len(cols))
    ]
    if fmt == "markdown":
        cells = [[_md_escape(text) for text in row] for row in [headers, *rows]]
        rule = ["---:" if num else "---" for num in numeric]
        lines = [cells[0], rule, *cells[1:]]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(cols))]
    lines = []
    for row in [headers, ["-" * w for w in widths], *rows]:
        padded = [
            text.rjust(w) if num else text.ljust(w)
            for text, w, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
