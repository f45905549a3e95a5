"""Slurm on the simulated cluster (tests/cluster.py): Debian's ``slurmctld`` on the MLflow
host (the head node), one ``slurmd`` on each node, and ``munged`` for their authentication.

Each daemon runs in its host's network namespace and, as on a real cluster, under the name
slurm.conf gives its host: slurmctld and each slurmd run in a UTS namespace of their own
whose host name is that name, and in a mount namespace where ``/etc/hosts`` maps the names
to the subnet's addresses (the machine's own file is left alone). The job steps slurmd
starts inherit both, so ``scontrol show hostnames`` gives names the ranks resolve. One
``munged`` with a key made here serves every host through its socket in the cluster's
folder (a Unix socket is reached through the filesystem, which the namespaces share).

Needs root, ``slurmctld``, ``slurmd`` (Debian's ``slurm-wlm``) and ``munged``
(``munge``): :func:`unavailable` says which is missing. The clients (``sbatch``,
``scontrol``, ``squeue``) run on the head node with ``SLURM_CONF`` naming the cluster's
slurm.conf: see :meth:`Slurm.client`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster import Cluster, Host

SLURMCTLD = Path("/usr/sbin/slurmctld")
SLURMD = Path("/usr/sbin/slurmd")
MUNGED = Path("/usr/sbin/munged")
HEAD = "head"
"""The head node's name in slurm.conf: the MLflow host, which runs slurmctld."""
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def unavailable() -> str | None:
    """Why Slurm cannot run on the simulated cluster here, or None when it can (the
    cluster's own needs are tests/cluster.py's :func:`cluster.unavailable`)."""
    if os.geteuid() != 0:
        return "slurmd runs jobs as root here: needs root"
    for daemon, package in ((SLURMCTLD, "slurm-wlm"), (SLURMD, "slurm-wlm"), (MUNGED, "munge")):
        if not daemon.is_file():
            return f"no {daemon} (install Debian's {package})"
    tools = [(tool, "slurm-wlm") for tool in ("sbatch", "scontrol", "sinfo", "scancel")]
    for tool, package in [*tools, ("nsenter", "util-linux"), ("unshare", "util-linux")]:
        if shutil.which(tool) is None:
            return f"no `{tool}` (install Debian's {package})"
    return None


def node_name(host: Host) -> str:
    """A node's name in slurm.conf: its namespace's name without the cluster's prefix."""
    return host.name.rsplit("-", 1)[1]


@dataclass
class Slurm:
    """slurmctld, the slurmds and munged on an up :class:`Cluster`; :meth:`up` starts them,
    the cluster's :meth:`Cluster.down` stops them with every other process it made."""

    cluster: Cluster
    root: Path = field(init=False)
    slurmds: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = self.cluster.root / "slurm"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def head(self) -> Host:
        assert self.cluster.mlflow is not None
        return self.cluster.mlflow

    def _write_config(self) -> None:
        root = self.root
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{host.address} {node_name(host)}\n" for host in self.cluster.hosts
        )
        (root / "hosts").write_text(hosts + f"{self.head.address} {HEAD}\n")
        nodes = "".join(
            f"NodeName={node_name(h)} NodeAddr={h.address} CPUs=1 RealMemory=1000 State=UNKNOWN\n"
            for h in self.cluster.hosts
        )
        names = ",".join(node_name(h) for h in self.cluster.hosts)
        # Every path in the cluster's folder, %n a node's own; no cgroups, no accounting:
        # the daemons run as root in namespaces, as many slurmds as nodes on one machine.
        self.conf.write_text(
            f"ClusterName=msf\nSlurmctldHost={HEAD}({self.head.address})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={root / 'munge.socket'}\n"
            f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root / 'spool-%n'}\n"
            f"SlurmctldPidFile={root / 'slurmctld.pid'}\nSlurmdPidFile={root / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={root / 'slurmctld.log'}\nSlurmdLogFile={root / 'slurmd-%n.log'}\n"
            f"PlugStackConfig={root / 'plugstack.conf'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSwitchType=switch/none\n"
            "MpiDefault=none\nSelectType=select/linear\nSchedulerType=sched/builtin\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\n"
            "SlurmdParameters=config_overrides\nReturnToService=1\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\nMinJobAge=600\nKillWait=30\n"
            "InactiveLimit=0\nSlurmdTimeout=60\nSlurmctldTimeout=60\nMessageTimeout=30\n"
            f"{nodes}PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"
        )
        (root / "plugstack.conf").write_text("")

    def _daemon(self, host: Host, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        """``cmd`` on ``host`` under the host name ``name``, with the cluster's hosts file."""
        log = open(self.root / f"{name}.out", "ab")  # noqa: SIM115
        setup = f"hostname {name} && mount --bind {self.root / 'hosts'} /etc/hosts && exec "
        # nsenter, not `ip netns exec`: that one mounts a /sys of its own, without the
        # machine's cgroup filesystems, which slurmd's cgroup plugin needs to start.
        return self.cluster.spawn(
            None,
            ["nsenter", f"--net=/run/netns/{host.name}", "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c", setup + " ".join(cmd)],
            log,
        )  # fmt: skip

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        log = open(self.root / "munged.out", "ab")  # noqa: SIM115
        self.cluster.spawn(
            None,
            [
                str(MUNGED), "--foreground", "--force", f"--key-file={key}",
                f"--socket={self.root / 'munge.socket'}", f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munge.seed'}",
            ],
            log,
        )  # fmt: skip
        self._wait(lambda: (self.root / "munge.socket").exists(), 20, "munged made no socket")

    def up(self) -> Slurm:
        self.root.mkdir()
        for folder in ("state", *(f"spool-{node_name(h)}" for h in self.cluster.hosts)):
            (self.root / folder).mkdir()
        self._write_config()
        self._start_munge()
        self._daemon(self.head, HEAD, [str(SLURMCTLD), "-D", "-i", "-f", str(self.conf)])
        self.cluster.wait_port(self.head, 6817, 60)
        for host in self.cluster.hosts:
            self.start_slurmd(host)
        self.wait_idle()
        return self

    def start_slurmd(self, host: Host) -> None:
        name = node_name(host)
        cmd = [str(SLURMD), "-D", "-N", name, "-f", str(self.conf)]
        self.slurmds[name] = self._daemon(host, name, cmd)

    def lose_node(self, host: Host) -> None:
        """What a node that fails leaves: its slurmd and every process of its jobs gone
        at once (SIGKILL). Slurm notices after SlurmdTimeout; :meth:`restore_nodes` brings
        it back."""
        self.cluster.stop_daemon(self.slurmds.pop(node_name(host)), grace=0)
        self.cluster.kill_jobs(host)

    def cancel_all(self) -> None:
        """Cancels every job and waits until none is left, requeued ones included."""
        deadline = time.monotonic() + 120
        while self.client(["squeue", "-h", "-o", "%i"]).stdout.strip():
            self.client(["scancel", "--user", "root"], check=False)
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs left after 120 s of scancel; logs in {self.root}")
            time.sleep(1)

    def restore_nodes(self) -> None:
        """Every node up and idle again, after a test that lost one or set it down."""
        for host in self.cluster.hosts:
            if node_name(host) not in self.slurmds:
                self.start_slurmd(host)
        shown = self.client(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
        for name, state in (line.split() for line in shown if line.strip()):
            if state.rstrip("*") not in ("idle", "allocated", "mixed", "completing"):
                self.client(["scontrol", "update", f"nodename={name}", "state=resume"])
        self.wait_idle()

    def wait_idle(self) -> None:
        """Returns once every node is idle: registered, up and running no job."""
        self._wait(self._nodes_idle, 90, "not every node is idle")

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout} s; logs in {self.root}")
            time.sleep(0.5)

    def _node_states(self) -> list[str]:
        return self.client(["sinfo", "-h", "-o", "%T", "-N"], check=False).stdout.split()

    def _nodes_idle(self) -> bool:
        states = self._node_states()
        return len(states) == len(self.cluster.hosts) and all(s == "idle" for s in states)

    def _nodes_completing(self) -> bool:
        return any(state.startswith("completing") for state in self._node_states())

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with ``SLURM_CONF``: what Slurm's clients and jobs read."""
        return {**base, "SLURM_CONF": str(self.conf)}

    def client(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        check: bool = True,
        **kwargs: object,
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command run on the head node."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.head.name, *cmd],
            env=self.environment(env or dict(os.environ)),
            capture_output=True,
            text=True,
            timeout=60,
            **kwargs,  # type: ignore[call-overload]
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (JobState, Restarts, NodeList...)."""
        shown = self.client(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def start_requeued(self, job_id: str, restarts: int, timeout: float = 120) -> None:
        """Waits until ``job_id`` is pending after its ``restarts``-th requeue, then lets it
        start at once: Slurm holds a requeued job for two minutes (its BeginTime).

        That hold is what keeps the new start's credential apart from the old one, which each
        slurmd revoked when it killed the job: slurmd compares the two times to the second,
        and refuses a credential made in the second of the revocation ("Job credential
        revoked": the job fails). So the start waits until no node is still completing the
        old run (every slurmd has revoked) and the clock has reached the next second."""
        self.wait_job(
            job_id,
            lambda job: job["JobState"] == "PENDING" and job["Restarts"] == str(restarts),
            timeout,
            f"no requeue number {restarts}",
        )
        self._wait(lambda: not self._nodes_completing(), 90, "a node is still completing")
        time.sleep(1 - time.time() % 1)
        self.client(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])

    def wait_job(
        self, job_id: str, done: Callable[[dict[str, str]], bool], timeout: float, what: str
    ) -> dict[str, str]:
        """Waits until ``done(job)`` holds for ``job_id``'s fields; fails naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if done(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id}: {what} within {timeout} s; it is {job.get('JobState')} "
                    f"({job.get('Reason')}), restarts {job.get('Restarts')}"
                )
            time.sleep(0.5)


@contextlib.contextmanager
def slurm(cluster: Cluster) -> Iterator[Slurm]:
    """Slurm started on ``cluster``; its daemons stop with the cluster."""
    yield Slurm(cluster).up()
