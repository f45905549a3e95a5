"""The ranks' signal handling and standard streams (training/signals.py): what lets a rank
whose launcher is gone still save and exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megasemface.training.signals import SIGNALS, StopRequest


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_repeated_sigterm_sighup_and_sigusr1_are_absorbed(
    restored_handlers: None, sig: signal.Signals
) -> None:
    stop = StopRequest()
    for _ in range(3):  # a launcher passing its own signals on, more than once
        os.kill(os.getpid(), sig)
    assert stop.signal_name == sig.name
    assert signal.getsignal(sig) == stop._handle


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_a_signal_before_the_training_loop_stops_it_at_its_first_step(
    restored_handlers: None, sig: signal.Signals
) -> None:
    from megasemface.training import signals

    signals.catch_stop_signals()
    try:
        os.kill(os.getpid(), sig)  # while the rank imports, meets the others, loads
        stop = StopRequest()
    finally:
        signals._caught.clear()
    assert stop.signal_name == sig.name
    # A second SIGINT still interrupts; the other signals are the request's from now on.
    expected = signal.SIG_DFL if sig == signal.SIGINT else stop._handle
    assert signal.getsignal(sig) == expected


def test_a_second_sigint_is_left_to_its_default_action(restored_handlers: None) -> None:
    stop = StopRequest()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signal_name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL


RANK = """
import sys, time
from megasemface.training.signals import survive_lost_output
survive_lost_output()
assert sys.stdout.buffer is sys.__stdout__.buffer
assert sys.stdout.encoding == sys.__stdout__.encoding
time.sleep(0.5)  # the reader is gone by now
for i in range(10_000):
    print(f"progress line {i}", flush=i % 100 == 0)
    print(f"warning {i}", file=sys.stderr)
open(sys.argv[1], "w").write("saved")
"""


@pytest.mark.parametrize("survive", [True, False])
def test_a_rank_whose_reader_is_gone_still_finishes(tmp_path: Path, survive: bool) -> None:
    script = RANK if survive else RANK.replace("survive_lost_output()", "")
    marker = tmp_path / "saved"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # an ssh session closing: both streams' reader gone
    proc.stderr.close()
    code = proc.wait(60)
    # Without the guard the first write to the closed pipe raises and the "save" is lost.
    assert (code, marker.exists()) == ((0, True) if survive else (1, False))
