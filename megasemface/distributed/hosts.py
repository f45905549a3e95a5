"""Whether every node of a multi-node DeepSpeed launch can be reached, before the rendezvous.

``deepspeed --hostfile hostfile`` checks ssh to the first host only, then starts every
node's launcher through pdsh. When another node cannot be reached (a wrong address in the
hostfile, no sshd there), pdsh prints its ssh failure among the nodes' logs and the ranks
that did start wait at the rendezvous for ranks that never come, until DeepSpeed's
30-minute timeout. Rank 0 checks each node here instead, the way pdsh reaches it (ssh), and
the run stops at once with one line naming the node.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["SSH_CONNECT_S", "check_nodes", "deepspeed_hosts", "unreachable_hosts"]

SSH_CONNECT_S = 10
"""How long a node gets to answer ssh: a node that is up answers within a second."""


def deepspeed_hosts(parent: int | None = None) -> list[str] | None:
    """The hosts of the hostfile DeepSpeed's runner launched this rank on over ssh (pdsh),
    from its launcher's ``--world_info`` (the launcher is the rank's parent), or None when
    this rank was not started so: one machine, ``--no_ssh``, or another launcher."""
    if "SSH_CONNECTION" not in os.environ:  # pdsh reaches every node, this one too, by ssh
        return None
    try:
        argv = Path(f"/proc/{parent or os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for arg in argv:
        if arg.startswith(b"--world_info="):
            info = json.loads(base64.urlsafe_b64decode(arg.split(b"=", 1)[1]))
            hosts = list(info)
            return hosts if len(hosts) > 1 else None
    return None


def _ssh_problem(host: str, port: str | None) -> str | None:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_S}"]
    cmd += ["-p", port] if port else []
    try:
        done = subprocess.run(
            [*cmd, host, "true"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=SSH_CONNECT_S + 5,
        )
    except subprocess.TimeoutExpired:
        return "ssh timed out"
    except OSError as exc:
        return f"cannot run ssh: {exc}"
    if done.returncode == 0:
        return None
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return said[-1] if said else f"ssh exited with {done.returncode}"


def unreachable_hosts(hosts: list[str]) -> list[tuple[str, str]]:
    """(host, ssh's reason) for each of ``hosts`` that ssh cannot run a command on, asked
    all at once, on the port this node's own sshd was reached on (DeepSpeed's
    ``--ssh_port`` is one port for every node)."""
    server_port = os.environ.get("SSH_CONNECTION", "").split()[3:4]
    port = server_port[0] if server_port else None
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        problems = list(pool.map(lambda host: _ssh_problem(host, port), hosts))
    return [
        (host, problem)
        for host, problem in zip(hosts, problems, strict=True)
        if problem is not None
    ]


def check_nodes() -> None:
    """Raises ValueError naming every node of a pdsh launch that ssh cannot reach."""
    hosts = deepspeed_hosts()
    lost = unreachable_hosts(hosts) if hosts else []
    if lost:
        named = "; ".join(f"{host} ({reason})" for host, reason in lost)
        raise ValueError(
            f"cannot reach node {named} of the hostfile over ssh: correct its address in the "
            "hostfile, or start sshd there"
        )
