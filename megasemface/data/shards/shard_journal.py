"""The journal of a shard build: what is complete, so that an interrupted build can resume.

One JSON record a line, each appended and fsynced: first the build's fingerprint, then one
record per completed shard (with the input line it ends at and the filter counts so far) and
one per completed language. A kill can cut only the last line, which is then ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megasemface.data.shards.shard_build_config import ShardBuildError

__all__ = ["JOURNAL", "BuildJournal"]

JOURNAL = ".build-journal.jsonl"
"""The journal's file name in the output directory; removed once the manifest is written."""


class BuildJournal:
    """Append-only record of completed shards and languages; survives kill -9."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.entries: list[dict[str, Any]] = []
        if path.exists():
            lines = path.read_bytes().splitlines()
            records = []
            for i, line in enumerate(lines):
                try:
                    record = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    record = None
                if isinstance(record, dict):
                    records.append(record)
                elif i != len(lines) - 1:  # only the last line may be cut by a kill
                    raise ShardBuildError(
                        f"{path}: line {i + 1} is corrupt; pass --overwrite to start again"
                    )
            if not records or records[0].get("fingerprint") != fingerprint:
                raise ShardBuildError(
                    f"{path.parent} holds an unfinished build with other inputs or options; "
                    "rerun with the original arguments, or pass --overwrite to start again"
                )
            self.entries = records[1:]
        else:
            self._append({"fingerprint": fingerprint})

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def add(self, record: dict[str, Any]) -> None:
        self._append(record)
        self.entries.append(record)

    def shards(self, lang: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e.get("kind") == "shard" and e["shard"]["lang"] == lang]

    def language_done(self, lang: str) -> dict[str, Any] | None:
        for entry in self.entries:
            if entry.get("kind") == "language" and entry["lang"] == lang:
                return entry
        return None
