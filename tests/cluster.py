"""A cluster on one Linux machine: nodes and an MLflow server host, each a network namespace.

The hosts are network namespaces on a private /24 that only this module creates, joined by
veth pairs to a bridge that lives in a namespace of its own (the machine's own namespace
gets no address and no route). Every node runs the real ``sshd`` with a host key and a
client key made here, so DeepSpeed's multi-node runner (pdsh over ssh) reaches them as it
reaches the nodes of a real cluster; gloo carries the collectives over the veth links. The
namespaces share the machine's filesystem: the checkout, the virtual environment and the
output directory are at the same path on every node, as the README asks of a cluster.

Needs root, ``ip`` (iproute2), ``/usr/sbin/sshd`` (Debian's ``openssh-server``) and ``pdsh``;
:func:`unavailable` says which is missing. Used by tests/test_cluster.py's fixture, and as a
script, to try a command on the cluster by hand::

    python tests/cluster.py [--nodes 2] -- COMMAND...

brings the cluster up, runs COMMAND on the first node with the cluster's environment (its
``hostfile``, ``MLFLOW_URI``, ``PATH`` with the ssh that holds the key) and tears it down.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

IFNAME = "eth0"
"""Every host's link to the bridge has this name (namespaces keep names apart), so one
GLOO_SOCKET_IFNAME serves every node."""
SSHD = Path("/usr/sbin/sshd")
CLONE_NEWNET = 0x40000000
MLFLOW_PORT = 5000

_T = TypeVar("_T")


def unavailable() -> str | None:
    """Why a cluster cannot be made on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool, package in (("ip", "iproute2"), ("pdsh", "pdsh"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"no `{tool}` (install Debian's {package})"
    if not SSHD.is_file():
        return f"no {SSHD} (install Debian's openssh-server)"
    probe = f"msfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def in_namespace(netns: str, fn: Callable[[], _T]) -> _T:
    """``fn()`` run in a thread that has entered ``netns``: the test process reads the
    simulated MLflow server from there (a namespace is per thread; the process stays put)."""
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {netns}")
        finally:
            os.close(fd)
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@dataclass
class Host:
    name: str
    """The namespace's name."""
    address: str


@dataclass
class Cluster:
    """Nodes and an MLflow host on a private subnet; :meth:`up` makes them, :meth:`down`
    removes everything :meth:`up` made (also after a partial :meth:`up`)."""

    root: Path
    """Where keys, configs, logs and the MLflow store go (a test's temporary folder)."""
    nodes: int = 2
    prefix: str = field(default_factory=lambda: f"msf{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    mlflow: Host | None = None
    _namespaces: list[str] = field(default_factory=list)
    _daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def mlflow_uri(self) -> str:
        assert self.mlflow is not None
        return f"http://{self.mlflow.address}:{MLFLOW_PORT}"

    @property
    def bin(self) -> Path:
        """Holds ``ssh``: the system's, with this cluster's key and known hosts (what a
        user's ~/.ssh/config gives; root's own is left alone)."""
        return self.root / "bin"

    def _subnet(self) -> str:
        """A 10.x.y.0/24 that no interface of the machine is on."""
        used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        draw = random.Random(self.prefix)
        for _ in range(100):
            subnet = f"10.{draw.randrange(100, 250)}.{draw.randrange(1, 250)}"
            if f" {subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet")

    def _add_host(self, name: str, address: str) -> Host:
        netns = f"{self.prefix}-{name}"
        _run("ip", "netns", "add", netns)
        self._namespaces.append(netns)
        port = f"{self.prefix[-6:]}{name}"[:15]
        _run(
            "ip", "link", "add", "name", port, "netns", self.switch, "type", "veth",
            "peer", "name", IFNAME, "netns", netns,
        )  # fmt: skip
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", IFNAME)
        _run("ip", "-n", netns, "link", "set", IFNAME, "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        return Host(netns, address)

    def _keys(self) -> None:
        for key in ("host_key", "id_ed25519"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / key))
        shutil.copy(self.root / "id_ed25519.pub", self.root / "authorized_keys")
        (self.root / "ssh_config").write_text(
            "Host *\n  User root\n"
            f"  IdentityFile {self.root / 'id_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.root / 'known_hosts'}\n"
            "  StrictHostKeyChecking no\n  BatchMode yes\n  ConnectTimeout 5\n"
            "  LogLevel ERROR\n"
        )
        self.bin.mkdir()
        ssh = self.bin / "ssh"
        ssh.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.root / "ssh_config"} "$@"\n')
        ssh.chmod(0o755)

    def start_sshd(self, host: Host, private: Path | None = None) -> None:
        """sshd on ``host``; with ``private``, in a mount namespace of its own where that
        directory is an empty tmpfs: a node that does not share it with the others."""
        config = self.root / f"sshd-{host.name}.conf"
        config.write_text(
            f"ListenAddress {host.address}\nPort 22\nHostKey {self.root / 'host_key'}\n"
            f"PidFile {self.root / f'sshd-{host.name}.pid'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            # The keys lie in a test's temporary folder, whose modes sshd would refuse.
            "StrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        log = open(self.root / f"sshd-{host.name}.log", "wb")  # noqa: SIM115
        sshd = [str(SSHD), "-D", "-e", "-f", str(config)]
        if private is not None:
            private.mkdir(parents=True, exist_ok=True)
            mount = f"mount -t tmpfs {host.name} {private} && exec {' '.join(sshd)}"
            sshd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
        self.spawn(host, sshd, log)
        self.wait_port(host, 22, 20)

    def spawn(self, host: Host | None, cmd: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        """A daemon: ``cmd`` on ``host`` (on the machine itself for None), its output to
        ``log``, stopped by :meth:`down` (or by :meth:`stop_daemon`)."""
        where = [] if host is None else ["ip", "netns", "exec", host.name]
        proc = subprocess.Popen(
            [*where, *cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._daemons.append(proc)
        return proc

    def stop_daemon(self, proc: subprocess.Popen[bytes], grace: float = 3) -> None:
        self.stop(proc, grace)
        self._daemons.remove(proc)

    def start_mlflow(self) -> None:
        assert self.mlflow is not None
        store = self.root / "mlflow"
        store.mkdir(exist_ok=True)
        log = open(self.root / "mlflow-server.log", "ab")  # noqa: SIM115
        self._daemons.append(
            subprocess.Popen(
                [
                    "ip", "netns", "exec", self.mlflow.name,
                    str(Path(sys.executable).with_name("mlflow")), "server",
                    "--host", self.mlflow.address, "--port", str(MLFLOW_PORT), "--workers", "1",
                    "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
                    "--artifacts-destination", str(store / "artifacts"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=store,
            )
        )  # fmt: skip
        self.wait_port(self.mlflow, MLFLOW_PORT, 120)

    def wait_port(self, host: Host, port: int, timeout: float) -> None:
        def reachable() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((host.address, port), 1):
                return True
            return False

        deadline = time.monotonic() + timeout
        while not in_namespace(host.name, reachable):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.name}: nothing listens on port {port}")
            time.sleep(0.2)

    def up(self, *, sshd: bool = True, mlflow: bool = True) -> Cluster:
        """Makes the hosts and starts sshd on each node and the MLflow server."""
        subnet = self._subnet()
        _run("ip", "netns", "add", self.switch)
        self._namespaces.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        self._keys()
        self.hosts = [self._add_host(f"n{i + 1}", f"{subnet}.{i + 1}") for i in range(self.nodes)]
        self.mlflow = self._add_host("ml", f"{subnet}.100")
        if sshd:
            for host in self.hosts:
                self.start_sshd(host)
        if mlflow:
            self.start_mlflow()
        return self

    def add_node(self, name: str, private: Path | None = None) -> Host:
        """One more node on the subnet running sshd (see :meth:`start_sshd`), left out of
        :attr:`hosts` and of the default hostfile."""
        assert self.mlflow is not None
        host = self._add_host(
            name, self.mlflow.address.rsplit(".", 1)[0] + f".{50 + len(self._namespaces)}"
        )
        self.start_sshd(host, private)
        return host

    def hostfile(self, slots: int = 1, addresses: list[str] | None = None) -> Path:
        """A DeepSpeed hostfile naming the nodes by address (the machine's /etc/hosts is
        left alone), or naming ``addresses``."""
        path = self.root / "hostfile"
        names = addresses or [host.address for host in self.hosts]
        path.write_text("".join(f"{name} slots={slots}\n" for name in names))
        return path

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The first node's environment for ``deepspeed``: the ssh with the key first on
        PATH, and DS_ENV_FILE naming the variables pdsh must carry to every rank (DeepSpeed
        forwards only PYTHON*, MLFLOW*, MV2*, UCX* and NCCL* of its own environment)."""
        env_file = self.root / "deepspeed_env"
        env_file.write_text(
            f"DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\nGLOO_SOCKET_IFNAME={IFNAME}\n"
            f"PATH={self.bin}:/usr/local/bin:/usr/bin:/bin\n"
        )
        return {
            **base,
            "PATH": f"{self.bin}:{base.get('PATH', '/usr/bin:/bin')}",
            "DS_ENV_FILE": str(env_file),  # an absolute path: DeepSpeed joins it to ~ and .
            "GLOO_SOCKET_IFNAME": IFNAME,
        }

    def popen(
        self, host: Host, cmd: list[str], env: dict[str, str], **kwargs: object
    ) -> subprocess.Popen[str]:
        """``cmd`` started on ``host`` in its own process group."""
        return subprocess.Popen(
            ["ip", "netns", "exec", host.name, *cmd],
            env=env,
            text=True,
            start_new_session=True,
            **kwargs,  # type: ignore[call-overload]
        )

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 3) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_mlflow(self) -> None:
        for proc in list(self._daemons):
            if "server" in proc.args:  # type: ignore[operator]
                self.stop_daemon(proc)

    def kill_jobs(self, host: Host) -> None:
        """SIGKILLs every process on ``host`` but its daemons (sshd stays up): what a node
        whose job dies (out of memory, a hardware fault) leaves behind."""
        daemons = {proc.pid for proc in self._daemons}
        listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True)
        for pid in map(int, listed.stdout.split()):
            if pid not in daemons:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def down(self) -> None:
        """Stops every process in the namespaces (the daemons started here and what came
        in over their ssh) and removes the namespaces, their links with them."""
        for proc in self._daemons:
            self.stop(proc)
        self._daemons.clear()
        for netns in self._namespaces:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._namespaces.clear()


@contextlib.contextmanager
def cluster(root: Path, nodes: int = 2, **up: bool) -> Iterator[Cluster]:
    """A cluster that is up inside the block and torn down after it, however it ends."""
    made = Cluster(root, nodes)
    try:
        yield made.up(**up)
    finally:
        made.down()


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"cluster: cannot run here: {reason}", file=sys.stderr)
        return 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with (
        tempfile.TemporaryDirectory(prefix="cluster-") as tmp,
        cluster(Path(tmp), args.nodes) as up,
    ):
        env = up.environment(dict(os.environ))
        env.update(HOSTFILE=str(up.hostfile()), MLFLOW_URI=up.mlflow_uri, CLUSTER_DIR=tmp)
        hosts = ", ".join(f"{h.name} {h.address}" for h in [*up.hosts, up.mlflow])  # type: ignore[list-item]
        print(f"cluster up: {hosts}; MLflow at {up.mlflow_uri}", flush=True)
        if not command:
            return 0
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear down on SIGTERM too
        return up.popen(up.hosts[0], command, env).wait()


if __name__ == "__main__":
    sys.exit(main())
