"""Starting the ranks of one machine: ``python -m megasemface.distributed.launch --nproc N
--master_port P script.py ARGS``.

What ``deepspeed --num_accelerators N`` does on one machine, without its cost: DeepSpeed's
runner and its launcher are two more Python processes that each import DeepSpeed (with torch
and MLflow, 3-5 s apiece on a 2-core machine), and the launcher notices a finished rank only
at its next one-second poll. This module imports neither torch nor DeepSpeed and waits on
the ranks themselves, so a run starts and ends with its ranks. The ranks see the environment
DeepSpeed's launcher gives them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``CROSS_RANK``, ``CROSS_SIZE`` and ``--local_rank=R``), so
``train.py`` runs alike under either. Several machines still go through ``deepspeed
--hostfile``.

Signals: SIGTERM is passed on to every rank (each saves after the current step and exits
0). SIGINT from the terminal already reaches every rank of the foreground process group, so
it is not passed on again (a second one would stop a rank in the middle of its checkpoint);
SIGHUP, from a closing terminal, likewise.
A rank that fails takes the others down (SIGTERM, then SIGKILL after a grace period), and
the launcher exits with the first failing rank's code.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from megasemface.command_line import CommandParser

__all__ = ["free_port", "launch", "rank_environment"]

GRACE_SECONDS = 30.0
"""How long the other ranks get to exit after one fails, before they are killed."""
POLL_SECONDS = 0.05
"""How often the ranks are checked: a finished run is noticed within this."""


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux keeps the range it takes the local ports of outgoing connections from."""
LOWEST_PORT = 20000
"""The lowest rendezvous port :func:`free_port` picks (below are well-known services')."""


_PORTS = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on, for a run's rendezvous (``--master_port``).

    Rank 0 binds it only after its imports, seconds later. A port the kernel hands out for
    binding port 0 is one it also hands out as the local port of new connections, and the
    gloo connections of other runs on the machine make many: one could take the port in
    between (the run then fails with EADDRINUSE). So the port comes from below the kernel's
    ephemeral range where that range is known, which only an explicit bind takes."""
    try:
        ephemeral_low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low - LOWEST_PORT >= 1000:
        # Drawn from the OS, not the global generator: a training loop in the same process
        # seeds that one with the run's seed, and two processes seeded alike (tests run side
        # by side) drew the same ports and met at each other's rendezvous.
        for port in _PORTS.sample(range(LOWEST_PORT, ephemeral_low), 64):
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_environment(
    base: dict[str, str], rank: int, nproc: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` on a single machine."""
    return {
        **base,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_SIZE": str(nproc),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _stop(ranks: list[subprocess.Popen[bytes]], grace: float) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    deadline = time.monotonic() + grace
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()


def launch(
    script_argv: Sequence[str],
    nproc: int,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
    grace: float = GRACE_SECONDS,
) -> int:
    """Runs ``python script_argv[0] --local_rank=R script_argv[1:]`` for R in 0..nproc-1
    and returns 0 when all exit 0, else the first non-zero exit code (a rank killed by a
    signal counts as 128 + its number, as a shell reports it)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    script, *args = script_argv
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", script, f"--local_rank={rank}", *args],
            env=rank_environment(dict(os.environ), rank, nproc, master_addr, master_port),
        )
        for rank in range(nproc)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    # The terminal's SIGINT reaches the ranks directly; the launcher waits for them to save.
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    failed = 0
    try:
        running = list(ranks)
        while running and not failed:
            time.sleep(POLL_SECONDS)
            for rank in [r for r in running if r.poll() is not None]:
                running.remove(rank)
                code = rank.returncode if rank.returncode >= 0 else 128 - rank.returncode
                if code != 0:
                    failed = code
                    break
        if failed:
            _stop(running, grace)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGHUP, previous_hup)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m megasemface.distributed.launch",
        description="Starts NPROC ranks of a DeepSpeed script on this machine.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start")
    parser.add_argument("--master_port", type=int, required=True, help="rendezvous port")
    parser.add_argument("--master_addr", default="127.0.0.1", help="rendezvous address")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    try:
        return launch(
            [args.script, *args.args],
            args.nproc,
            master_port=args.master_port,
            master_addr=args.master_addr,
        )
    except (ValueError, OSError) as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
