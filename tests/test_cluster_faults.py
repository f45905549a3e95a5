"""Faults of a multi-node run on the simulated cluster (tests/cluster.py), each tried on the
README's command: a node that does not share the output directory, SIGTERM on the first
node, the MLflow server going away mid-run, a node lost mid-run. Skipped where namespaces
cannot be made (see tests/test_cluster.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster import Cluster
from cluster_jobs import (
    error_lines,
    ranks_in,
    readme_command,
    run_on_first_node,
    server_run,
    start_on_first_node,
    wait_for_step,
)
from launch import losses

from megasemface.training.trainer import FLUSH_BEFORE_SAVE_S

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

RANKS_EXIT_S = 60
"""How long the ranks may take to save and exit once the job was signalled."""


def start_long_run(nodes: Cluster, launch_data: dict, out: Path) -> subprocess.Popen[str]:
    """The README's command for more steps than a test waits for, saving every 10."""
    cmd = readme_command(nodes, launch_data, out, "--steps", "1000", "--save-interval", "10")
    return start_on_first_node(nodes, cmd)


def wait_until_no_ranks(nodes: Cluster, timeout: float = RANKS_EXIT_S) -> None:
    deadline = time.monotonic() + timeout
    while ranks_in(nodes):
        assert time.monotonic() < deadline, f"ranks still running after {timeout} s"
        time.sleep(0.2)


def test_a_node_without_the_shared_output_dir_stops_the_start_in_one_line(
    nodes: Cluster, launch_data: dict, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    # The third node sees an empty filesystem of its own at the first node's `shared`.
    apart = nodes.add_node("n3", private=shared)
    out = shared / "run"
    hostfile = nodes.hostfile(addresses=[nodes.hosts[0].address, apart.address])
    cmd = readme_command(nodes, launch_data, out, "--steps", "4", hostfile=hostfile)
    result = run_on_first_node(nodes, cmd, timeout=120)
    assert result.returncode != 0
    (line,) = error_lines(result)
    assert f"--output-dir {out} on node " in line, line
    assert "(rank 1) is not the directory rank 0 writes" in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (out / "metrics.jsonl").exists()
    assert not list(out.glob(".shared-*"))  # rank 0 removed its token


@pytest.mark.parametrize("whom", ["ranks", "runner"])
def test_sigterm_on_the_first_node_saves_every_nodes_shard_and_the_run_resumes(
    nodes: Cluster, launch_data: dict, tmp_path: Path, whom: str
) -> None:
    out = tmp_path / "run"
    cmd = readme_command(nodes, launch_data, out, "--steps", "500", "--save-interval", "1000")
    proc = start_on_first_node(nodes, cmd)
    wait_for_step(out, 3, proc)
    if whom == "runner":
        # A scheduler's SIGTERM to the job: the runner, pdsh and its ssh clients. DeepSpeed's
        # runner passes it on (pkill over pdsh) and exits 1, its ssh sessions closing behind
        # it while the ranks save.
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        # `pkill -TERM -f megasemface/train.py` on the first node: its rank alone.
        for pid in ranks_in(nodes, nodes.hosts[:1]):
            os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    wait_until_no_ranks(nodes)
    assert proc.returncode == (1 if whom == "runner" else 0), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    stopped = max(losses(out))
    assert stopped < 500
    saved = out / "checkpoints" / f"step-{stopped:08d}"
    assert (saved / "COMPLETE").is_file(), output[-4000:]
    # Both nodes' ranks wrote their shard of the ZeRO-2 optimizer state.
    assert len(list(saved.rglob("*optim_states.pt"))) == 2
    assert server_run(nodes, out, ())["run"].info.status == "KILLED"

    cmd = readme_command(nodes, launch_data, out, "--steps", str(stopped + 2))
    resumed = run_on_first_node(nodes, cmd)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"(step {stopped})" in resumed.stdout, resumed.stdout[-4000:]
    assert sorted(losses(out)) == list(range(1, stopped + 3))


def test_the_mlflow_server_restarted_mid_run_stalls_no_step_and_loses_no_metric(
    nodes: Cluster, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = start_long_run(nodes, launch_data, out)
    try:
        wait_for_step(out, 3, proc)
        nodes.stop_mlflow()
        down_at = max(losses(out))
        wait_for_step(out, down_at + 12, proc)  # a checkpoint is taken while it is down
    finally:
        nodes.start_mlflow()  # the same store, as after a server's restart
    back_at = max(losses(out))
    wait_for_step(out, back_at + 12, proc)  # and one after it is back
    # The tracker retries with a backoff of up to a minute: wait until it has found the
    # server back (a step logged after the restart is there) before the run ends.
    deadline = time.monotonic() + 150
    while max(server_run(nodes, out, ("loss",))["history"]["loss"]) <= back_at:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(1)
    for pid in ranks_in(nodes, nodes.hosts[:1]):  # the run ends with a stop, at a step
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    stopped = max(losses(out))

    # Every step's metrics reached the server, those of the outage included.
    tracked = server_run(nodes, out, ("loss", "lr"))
    assert tracked["run"].info.status == "KILLED"
    for key in ("loss", "lr"):
        assert sorted(tracked["history"][key]) == list(range(1, stopped + 1)), key
    # No step waited on the server beyond what docs/pretraining.md states: a step never, a
    # checkpoint at most FLUSH_BEFORE_SAVE_S for the metrics logged before it (it takes that
    # long while the tracker replays the outage's metrics to the server).
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saves = {r["step"]: r["checkpoint_seconds"] for r in records if "checkpoint_seconds" in r}
    assert max(saves.values()) < FLUSH_BEFORE_SAVE_S + 1
    times = {r["step"]: r["time"] for r in records if "loss" in r}
    stalls = [times[s] - times[s - 1] for s in times if s - 1 in times and s - 1 not in saves]
    assert max(stalls) < FLUSH_BEFORE_SAVE_S


def test_a_node_lost_mid_run_stops_the_others_in_one_line_and_the_rest_resume(
    nodes: Cluster, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = start_long_run(nodes, launch_data, out)
    wait_for_step(out, 25, proc)
    lost = nodes.hosts[1]
    nodes.kill_jobs(lost)  # every process of the run on that node, SIGKILLed
    started = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    assert time.monotonic() - started < RANKS_EXIT_S
    wait_until_no_ranks(nodes)
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-4000:]
    (line,) = [line for line in output.splitlines() if "train: error" in line]
    checkpoints = out / "checkpoints"
    newest = max(path.name for path in checkpoints.glob("step-*"))
    assert f"lost node {lost.address} (Connection " in line, line
    assert f"the last complete checkpoint is {checkpoints / newest} (step " in line, line
    # Every checkpoint on disk is complete: no rank was writing one when the node went.
    for path in checkpoints.glob("step-*"):
        assert (path / "COMPLETE").is_file() or path.name > newest, path
    resumed_at = int(newest.removeprefix("step-"))

    # The same command on the node that is left, its one rank resuming 2 ranks' checkpoint.
    hostfile = nodes.hostfile(addresses=[nodes.hosts[0].address])
    end = resumed_at + 2
    again = readme_command(nodes, launch_data, out, "--steps", str(end), hostfile=hostfile)
    again[again.index("--num_nodes") + 1] = "1"
    resumed = run_on_first_node(nodes, again)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert f"(step {resumed_at})" in resumed.stdout, resumed.stdout[-4000:]
    assert f"step {end}/{end} " in resumed.stdout, resumed.stdout[-4000:]
