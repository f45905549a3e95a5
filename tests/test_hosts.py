"""Which nodes rank 0 checks before the rendezvous (megasemface/distributed/hosts.py): the
hosts of DeepSpeed's ``--world_info`` in its launcher's command line, under pdsh only."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megasemface.distributed.hosts import deepspeed_hosts


def world_info(hosts: dict[str, list[int]]) -> str:
    """What DeepSpeed's runner passes its launchers (runner.encode_world_info)."""
    return base64.urlsafe_b64encode(json.dumps(hosts).encode()).decode()


@pytest.fixture
def launcher() -> Iterator[Callable[..., int]]:
    """Starts a process with a launcher's command line and returns its pid (a rank's
    parent, as DeepSpeed's launcher is)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> int:
        sleep = "import time; time.sleep(30)"  # the arguments after it are only its argv
        started.append(subprocess.Popen([sys.executable, "-c", sleep, *args]))
        cmdline = Path(f"/proc/{started[-1].pid}/cmdline")
        deadline = time.monotonic() + 10
        while sleep.encode() not in cmdline.read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline, "the process did not start"
            time.sleep(0.01)
        return started[-1].pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_the_hosts_of_a_pdsh_launch_come_from_the_launchers_world_info(
    launcher: Callable[..., int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.1 40000 10.0.0.2 22")
    hosts = {"worker-1": [0, 1], "worker-2": [0, 1]}
    pid = launcher("-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info(hosts)}")
    assert deepspeed_hosts(pid) == ["worker-1", "worker-2"]


def test_one_node_or_a_launch_without_ssh_checks_nothing(
    launcher: Callable[..., int], monkeypatch: pytest.MonkeyPatch
) -> None:
    two = launcher(f"--world_info={world_info({'a': [0], 'b': [0]})}")
    one = launcher(f"--world_info={world_info({'localhost': [0, 1]})}")
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.1 40000 10.0.0.2 22")
    assert deepspeed_hosts(one) is None
    assert deepspeed_hosts(launcher("--nproc", "2")) is None  # megasemface's own launcher
    monkeypatch.delenv("SSH_CONNECTION")  # started by hand (--no_ssh), not by pdsh
    assert deepspeed_hosts(two) is None
