"""Graceful stop on SIGTERM, SIGINT, SIGHUP or SIGUSR1, agreed by all ranks at a step boundary.

A signal only sets a flag; the trainer all-reduces the flag at every step boundary, so
whichever rank was signalled, every rank sees it after the same step, saves a checkpoint
with the others and exits 0. A second SIGINT is left to its default action, so an
impatient user can still interrupt; repeated SIGTERMs and SIGHUPs are absorbed, because
launchers send them more than once (DeepSpeed's node launcher passes SIGTERM on to its
ranks as often as it is signalled itself: twice when its runner is stopped) and escalate
to SIGKILL after a grace period of their own. SIGUSR1 is the signal a Slurm job asks for
ahead of its time limit or preemption (``#SBATCH --signal=B:USR1@300``, passed on to the
ranks by the batch script, examples/slurm/pretrain.sbatch); its default action would kill
the rank without a checkpoint.

On a cluster the ranks' output reaches the user through the launcher: DeepSpeed's runner
starts each node's ranks through pdsh and ssh, and when the runner is stopped, the ssh
sessions close before the ranks have saved. A write to the closed pipe would then raise and
kill the rank in the middle of its save, so the ranks' standard streams survive it (see
:func:`survive_lost_output`), and SIGHUP, which a closing terminal or session sends, stops
the run like SIGTERM.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from types import FrameType
from typing import TextIO

__all__ = ["StopRequest", "catch_stop_signals", "survive_lost_output"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

_caught: list[str] = []
"""The stop signals received before the training loop began (see :func:`catch_stop_signals`)."""


def _record(signum: int, frame: FrameType | None) -> None:
    _caught.append(signal.Signals(signum).name)
    if signum == signal.SIGINT:
        signal.signal(signum, signal.SIG_DFL)


def catch_stop_signals() -> None:
    """Records the stop signals from now on, for the :class:`StopRequest` made later.

    A rank takes a while to import, meet the others and load its checkpoint, and a
    scheduler's signal may come in that time (Slurm sends ``--signal``'s up to a minute
    early); the signals' default action would end the rank there, without a checkpoint.
    Recorded, the signal stops the run at its first step boundary instead."""
    for sig in SIGNALS:
        signal.signal(sig, _record)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = _caught[-1] if _caught else None
        caught, _caught[:] = list(_caught), []  # the next run in this process starts afresh
        for sig in SIGNALS:
            if sig.name not in caught or sig != signal.SIGINT:  # a second SIGINT stays fatal
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (a collective: call on all)."""
        # Imported here: catch_stop_signals runs before torch is imported.
        from megasemface.distributed.collectives import any_rank

        return any_rank(self.signal_name is not None)


class _SurvivingStream(io.TextIOBase):
    """A standard stream that, once its reader is gone, writes to /dev/null instead of
    raising: the descriptor itself is pointed at /dev/null, so that what C code and the
    original stream's buffer write afterwards goes there quietly too."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _lost(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (BrokenPipeError, ConnectionResetError):
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._lost()
            self._stream.flush()  # the buffer's bytes now go to /dev/null

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    def __getattr__(self, name: str) -> object:
        # What a text stream has beyond the above (``buffer``, ``reconfigure``, ...).
        return getattr(self._stream, name)


def survive_lost_output() -> None:
    """Makes ``sys.stdout`` and ``sys.stderr`` outlive their reader (a closed ssh session or
    pipe), so that a rank whose launcher is gone still saves and exits 0."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _SurvivingStream):
            try:
                stream.fileno()
            except (OSError, ValueError, io.UnsupportedOperation):
                continue  # not a descriptor (pytest's capture): nothing to point elsewhere
            setattr(sys, name, _SurvivingStream(stream))
