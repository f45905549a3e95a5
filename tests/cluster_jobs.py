"""The README's multi-node command on the simulated cluster (tests/cluster.py), and what the
tests read back of it: the nodes' output and the MLflow server's runs."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any
from unittest import mock

from cluster import Cluster, Host, in_namespace
from launch import DEEPSPEED, ROOT, environment, losses, train_command

STEPS = 4


def experiment(out: Path) -> str:
    """The MLflow experiment of the run in ``out``: one per test (the cluster's server
    outlives the tests)."""
    return f"cluster-{out.parent.name}"


def readme_command(
    up: Cluster, launch_data: dict, out: Path, *args: str, hostfile: Path | None = None
) -> list[str]:
    """The README's ``deepspeed --hostfile hostfile --num_nodes 2 --num_gpus N`` command on
    the tiny preset, one rank a node, tracking to the cluster's MLflow server."""
    data = {"shards": launch_data["mono"], "spm": launch_data["spm"]}
    cmd = train_command(
        data,
        out,
        "--stage",
        "encoder",
        "--interface",
        "vq",
        "--tracking-uri",
        up.mlflow_uri,
        "--experiment",
        experiment(out),
        *args,
        config=ROOT / "ds_configs" / "cpu_fp32_zero2.json",
        deepspeed=True,
    )
    hosts = str(hostfile or up.hostfile())
    # train_command's launcher is [deepspeed, --num_accelerators, N]; the README's replaces it.
    return [str(DEEPSPEED), "--hostfile", hosts, "--num_nodes", "2", "--num_gpus", "1", *cmd[3:]]


def run_on_first_node(
    up: Cluster, cmd: list[str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    proc = start_on_first_node(up, cmd, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        up.stop(proc)  # type: ignore[arg-type]
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out:\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def server_run(up: Cluster, out: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """What the MLflow server holds of the one run in ``out``, read with the client: the
    run, the steps of each metric (of ``keys`` only, if given) and the artifacts."""
    assert up.mlflow is not None

    def read() -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=up.mlflow_uri)
        found = client.get_experiment_by_name(experiment(out))
        (run,) = client.search_runs([found.experiment_id])
        history = {
            key: [m.step for m in client.get_metric_history(run.info.run_id, key)]
            for key in (run.data.metrics if keys is None else keys)
        }
        artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
        return {"run": run, "history": history, "artifacts": artifacts}

    # The test's own reads retry, as a user's client does by default: megasemface's tracking
    # turns MLflow's retries off in any process that imports it, and a pooled keep-alive
    # connection the server closed (or one to a server since restarted) is reset on reuse.
    retries = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    with mock.patch.dict(os.environ, retries):
        return in_namespace(up.mlflow.name, read)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """megasemface's own error lines (pdsh prefixes them with the node's address)."""
    text = result.stdout + result.stderr
    return [line for line in text.splitlines() if "train: error" in line]


def start_on_first_node(
    up: Cluster, cmd: list[str], stderr: int = subprocess.STDOUT
) -> subprocess.Popen[str]:
    """``cmd`` started on the first node, its output read with communicate (both streams
    as one, unless ``stderr`` says otherwise)."""
    env = up.environment(environment())
    return up.popen(up.hosts[0], cmd, env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr)


def wait_for_step(out: Path, step: int, proc: subprocess.Popen[str], timeout: float = 180) -> None:
    """Returns once the run in ``out`` has logged ``step``; fails if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists() or max(losses(out), default=0) < step:
        if proc.poll() is not None:
            raise AssertionError(f"ended before step {step}:\n{proc.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {step} within {timeout} s")
        time.sleep(0.1)


def ranks_in(up: Cluster, hosts: list[Host] | None = None) -> list[int]:
    """The pids of train.py processes running on ``hosts`` (default: the cluster's nodes)."""
    pids = []
    for host in up.hosts if hosts is None else hosts:
        listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            # A rank, not the runner, pdsh or a launcher, whose arguments name train.py too.
            if b"megasemface/train.py\0--local_rank=" in cmdline:
                pids.append(int(pid))
    return pids
