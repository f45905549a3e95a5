"""Graceful stop on SIGTERM or SIGINT, agreed by all ranks at a step boundary.

A signal only sets a flag; the trainer all-reduces the flag at every step boundary, so
whichever rank was signalled, every rank sees it after the same step, saves a checkpoint
with the others and exits 0. A second signal of the same kind is left to its default
action, so an impatient user can still interrupt.
"""

from __future__ import annotations

import signal
from types import FrameType

from megasemface.distributed.collectives import any_rank

__all__ = ["StopRequest"]


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (a collective: call on all)."""
        return any_rank(self.signal_name is not None)
