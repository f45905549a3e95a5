"""Writing checkpoints during training: atomic completion, discovery of the newest, pruning.

Layout under ``<output>/checkpoints/``::

    step-00000100/            DeepSpeed's files (model and ZeRO-sharded optimizer states,
                              client_state with step counters, run ids and the configuration)
    step-00000100/rank-00001.json   this rank's loader position and RNG states (JSON: no pickle)
    step-00000100/COMPLETE    written by rank 0 after every rank has finished writing
    step-00000100/universal/  only after a resume on another number of data-parallel ranks:
                              DeepSpeed's universal form of the checkpoint (checkpoints.universal)
    latest                    the newest complete checkpoint's tag, written after COMPLETE

A checkpoint without ``COMPLETE`` (the run was killed while writing it) is never resumed from
and is removed by the next save. ``latest`` is DeepSpeed's own pointer file: its tools
(``zero_to_fp32.py``, copied into this folder) read it when no tag is given; megasemface
resumes from the newest ``COMPLETE`` checkpoint and does not read it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megasemface.checkpoints.layout import MARKER, TAG_PATTERN, checkpoint_tag
from megasemface.files import atomic_write_text

__all__ = ["CheckpointManager"]


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj))


class CheckpointManager:
    def __init__(self, output_dir: Path, keep_last: int, rank: int) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank

    @staticmethod
    def tag(step: int) -> str:
        return checkpoint_tag(step)

    def _tags(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = TAG_PATTERN.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def complete(self) -> list[tuple[int, Path]]:
        return [(step, path) for step, path in self._tags() if (path / MARKER).is_file()]

    def newest(self) -> tuple[int, str] | None:
        """(step, tag) of the newest complete checkpoint, or None."""
        done = self.complete()
        return (done[-1][0], done[-1][1].name) if done else None

    def save(
        self,
        step: int,
        write_engine_state: Callable[[Path, str], None],
        rank_state: dict[str, Any],
        barrier: Callable[[], None],
    ) -> Path:
        """Writes checkpoint ``step`` on every rank, then marks it complete (rank 0)."""
        tag = self.tag(step)
        self.root.mkdir(parents=True, exist_ok=True)
        write_engine_state(self.root, tag)
        _write_json(self.root / tag / f"rank-{self.rank:05d}.json", rank_state)
        barrier()
        if self.rank == 0:
            _write_json(self.root / tag / MARKER, {"step": step})
            # Only now, so DeepSpeed's tools never follow it to a half-written checkpoint.
            atomic_write_text(self.root / "latest", tag)
            self._prune()
        barrier()
        return self.root / tag

    def rank_states(self, tag: str) -> list[dict[str, Any]]:
        """What every rank that wrote checkpoint ``tag`` saved beside it, in rank order (they
        may have been more or fewer than this run has)."""
        paths = sorted((self.root / tag).glob("rank-*.json"))
        if not paths:
            raise FileNotFoundError(
                f"{self.root / tag} holds no rank-*.json: the checkpoint is damaged; remove it "
                "to resume from the one before"
            )
        states = []
        for path in paths:
            try:
                states.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(
                    f"{path} is unreadable ({exc}): the checkpoint is damaged; remove it to "
                    "resume from the one before"
                ) from None
        return states

    def _prune(self) -> None:
        done = self.complete()
        keep = {path for _, path in done[-self.keep_last :]}
        newest = done[-1][0] if done else -1
        for step, path in self._tags():
            # Older complete ones beyond keep_last, and incomplete ones a newer save replaced.
            if path not in keep and (step < newest or (path / MARKER).is_file()):
                shutil.rmtree(path, ignore_errors=True)
