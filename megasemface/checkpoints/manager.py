"""Writing checkpoints during training: atomic completion, discovery of the newest, pruning.

Layout under ``<output>/checkpoints/``::

    step-00000100/            DeepSpeed's files (model and ZeRO-sharded optimizer states,
                              client_state with step counters, run ids and the configuration)
    step-00000100/rank-00001.json   this rank's loader position and RNG states (JSON: no pickle)
    step-00000100/COMPLETE    written by rank 0 after every rank has finished writing
    step-00000100/universal/  only after a resume on another number of data-parallel ranks:
                              DeepSpeed's universal form of the checkpoint (checkpoints.universal)
    latest                    the newest complete checkpoint's tag, written after COMPLETE

A checkpoint without ``COMPLETE`` (the run was killed while writing it, or the disk filled
up) is never resumed from and is removed by the next save. ``latest`` is DeepSpeed's own
pointer file: its tools (``zero_to_fp32.py``, copied into this folder) read it when no tag is
given; megasemface resumes from the newest ``COMPLETE`` checkpoint and does not read it.

A save that fails because the disk is full raises :class:`DiskFullError` with one line that
names the checkpoint and the complete one the run can resume from; older checkpoints are
only pruned once a new one is complete, so that one is untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megasemface.checkpoints.layout import MARKER, TAG_PATTERN, checkpoint_tag
from megasemface.files import atomic_write_text

__all__ = ["FAULT_KILL_AT_SAVE", "CheckpointManager", "DiskFullError"]

FAULT_KILL_AT_SAVE = "MEGASEMFACE_FAULT_KILL_AT_SAVE"
"""For tests only: ``STEP:RANK`` makes rank RANK SIGKILL itself while saving checkpoint STEP,
after its files are written and before the checkpoint is marked complete (what a crash or a
preemption in the middle of a save leaves)."""

FULL_BELOW_BYTES = 1 << 20
"""A write that failed with less free space than this failed for lack of space.

torch's zip writer reports a full disk as a RuntimeError without the errno (``unexpected pos
...``), so the free space tells it apart from other failures."""


class DiskFullError(OSError):
    """A checkpoint could not be written for lack of space.

    ``quiet`` on a rank whose own writes did not fail (its collective broke when the failing
    rank stopped), so the run prints only the lines of the ranks whose writes failed.
    """

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(errno.ENOSPC, message)
        self.quiet = quiet

    def __str__(self) -> str:
        return str(self.strerror)


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
        """Writes checkpoint ``step`` on every rank, then marks it complete (rank 0).

        Raises :class:`DiskFullError` when a write fails on a full disk.
        """
        tag = self.tag(step)
        folder = self.root / tag
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.rank == 0 and folder.exists() and not (folder / MARKER).is_file():
                # What a run killed while saving this step left: no stale file may mix in.
                shutil.rmtree(folder)
            barrier()
            write_engine_state(self.root, tag)
            _write_json(folder / f"rank-{self.rank:05d}.json", rank_state)
            _fault_injection(step, self.rank)
            barrier()
            if self.rank == 0:
                _write_json(folder / MARKER, {"step": step})
                # Only now, so DeepSpeed's tools never follow it to a half-written checkpoint.
                atomic_write_text(self.root / "latest", tag)
                self._prune()
            barrier()
        except (OSError, RuntimeError) as exc:
            if not _disk_full(exc, self.root):
                raise
            raise DiskFullError(self._disk_full_message(step), quiet=_peer_stopped(exc)) from exc
        return folder

    def _disk_full_message(self, step: int) -> str:
        """One line: which save failed, what survives, what to do."""
        tag = self.tag(step)
        free = shutil.disk_usage(_existing(self.root)).free
        done = [(s, path) for s, path in self.complete() if s != step]
        if done:
            previous = done[-1][1]
            size = sum(f.stat().st_size for f in previous.iterdir() if f.is_file())
            survives = (
                f"the previous complete checkpoint {previous.name} is intact and the run "
                f"resumes from it when started again; a checkpoint of this run takes "
                f"{_mib(size)}, and --keep-last {self.keep_last} of them plus the one being "
                "written must fit"
            )
        else:
            survives = "no complete checkpoint exists yet, so a new start begins at step 0"
        return (
            f"checkpoint {self.root / tag} (step {step}) could not be written: the disk is full "
            f"({_mib(free)} free); {survives}. Free space there (the partial {tag} may be "
            "deleted) or move --output-dir, then start the run again"
        )

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


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (the file system it is on)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _disk_full(exc: BaseException, root: Path) -> bool:
    """Whether ``exc`` (or what caused it) is a write that found no space."""
    codes = {errno.ENOSPC, errno.EDQUOT}
    if any(isinstance(e, OSError) and e.errno in codes for e in _chain(exc)):
        return True
    try:
        return shutil.disk_usage(_existing(root)).free < FULL_BELOW_BYTES
    except OSError:
        return False


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def _peer_stopped(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that broke because another rank stopped, not a write
    of this rank (torch's distributed errors by type, gloo's by its message)."""
    import torch.distributed as dist

    return any(
        isinstance(e, dist.DistError) or any(s in str(e) for s in _PEER_GONE) for e in _chain(exc)
    )


def _fault_injection(step: int, rank: int) -> None:
    """For tests: SIGKILLs this rank at the save :data:`FAULT_KILL_AT_SAVE` names."""
    if os.environ.get(FAULT_KILL_AT_SAVE) == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
