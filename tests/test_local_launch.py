"""megasemface.distributed.launch: one machine's ranks, their environment, failures and
signals (with small scripts; train.py through it: tests/test_train_launcher.py)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import ROOT

from megasemface.distributed import launch as launch_module

RANK_SCRIPT = """
import json, os, sys
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "CROSS_RANK", "CROSS_SIZE"]
record = {"argv": sys.argv[1:], **{n: os.environ.get(n) for n in names}}
out = sys.argv[-1]
with open(f"{out}/rank{os.environ['RANK']}.json", "w") as f:
    json.dump(record, f)
"""

# Rank 1 fails at once; rank 0 would sleep for a minute unless stopped.
FAILING_SCRIPT = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
"""

# Each rank says it is ready, then waits for SIGTERM, notes it and exits 0 (a saved run).
SIGTERM_SCRIPT = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[-1])
def stop(signum, frame):
    (out / f"stopped{os.environ['RANK']}").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out / f"ready{os.environ['RANK']}").touch()
time.sleep(60)
"""


def _launcher(script: Path, *args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megasemface.distributed.launch",
        "--nproc",
        str(nproc),
        "--master_port",
        "29999",
        str(script),
        *args,
    ]


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.launcher
def test_every_rank_gets_the_environment_of_deepspeeds_launcher(tmp_path: Path) -> None:
    script = _script(tmp_path, RANK_SCRIPT)
    cmd = _launcher(script, "--flag", "value", str(tmp_path), nproc=3)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {
            "argv": [f"--local_rank={rank}", "--flag", "value", str(tmp_path)],
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
        }


@pytest.mark.launcher
def test_a_failing_rank_stops_the_others_and_gives_its_exit_code(tmp_path: Path) -> None:
    script = _script(tmp_path, FAILING_SCRIPT)
    started = time.monotonic()
    result = subprocess.run(_launcher(script), capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert time.monotonic() - started < 30  # rank 0 did not sleep its minute out


@pytest.mark.launcher
def test_sigterm_reaches_every_rank_which_exit_cleanly(tmp_path: Path) -> None:
    script = _script(tmp_path, SIGTERM_SCRIPT)
    process = subprocess.Popen(_launcher(script, str(tmp_path)), cwd=ROOT)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and process.poll() is None, "the ranks never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert [(tmp_path / f"stopped{r}").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"]


@pytest.mark.launcher
def test_bad_arguments_get_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, RANK_SCRIPT)
    cmd = _launcher(script, nproc=0)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "launch: error: --nproc must be at least 1, got 0"


# A rank's end after its run: a thread pool left idle (as inductor's compile pool is), a
# non-daemon thread still writing, an exit handler.
END_SCRIPT = """
import atexit, concurrent.futures, pathlib, sys, threading, time
from megasemface.distributed.engine import end_process
out = pathlib.Path(sys.argv[1])
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(time.sleep, 0.01).result()
def write():
    time.sleep(0.5)
    (out / "thread").write_text("done")
threading.Thread(target=write).start()
atexit.register(lambda: (out / "atexit").write_text((out / "thread").read_text()))
end_process(5)
"""


def test_end_process_joins_threads_then_runs_exit_handlers(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", END_SCRIPT, str(tmp_path)], cwd=ROOT, timeout=60, check=False
    )
    assert result.returncode == 5
    # The handler ran after the thread had finished; an idle thread pool did not hold it up.
    assert (tmp_path / "atexit").read_text() == "done"


def test_the_rendezvous_port_is_free_and_no_connection_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Below the kernel's range of ports for outgoing connections (which the gloo
    connections of other runs draw from), and nothing listens on it; where the range is
    unknown, a port the kernel picks."""
    low = int(launch_module.EPHEMERAL_PORTS.read_text().split()[0])
    assert low - launch_module.LOWEST_PORT >= 1000  # Linux's default range starts at 32768
    ports = {launch_module.free_port() for _ in range(8)}
    assert all(launch_module.LOWEST_PORT <= port < low for port in ports)
    assert len(ports) > 1  # drawn at random: two launches started together rarely collide
    # Not from the global generator, which a training loop seeds with the run's seed: two
    # processes seeded alike would draw the same ports.
    random.seed(0)
    state = random.getstate()
    launch_module.free_port()
    assert random.getstate() == state
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    busy, other = sorted(ports)[:2]
    with socket.socket() as held:  # a port in use is passed over
        held.bind(("127.0.0.1", busy))
        held.listen()
        monkeypatch.setattr(launch_module._PORTS, "sample", lambda *_: [busy, other])
        assert launch_module.free_port() == other
    monkeypatch.setattr(launch_module, "EPHEMERAL_PORTS", tmp_path / "missing")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", launch_module.free_port()))
