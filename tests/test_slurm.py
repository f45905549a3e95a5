"""examples/slurm/pretrain.sbatch on a simulated Slurm cluster (tests/slurm_cluster.py):
slurmctld on the MLflow host, a slurmd on each of 2 nodes, one CPU rank a node started by
srun, gloo between them. Each test submits the script as docs/pretraining.md says, with the
#SBATCH lines a user edits given on sbatch's command line (2 nodes of one CPU, no GPU), then
faults it as a cluster does: preemption's signal, the time limit, scancel, a node lost.
Skipped where the simulated cluster or Slurm cannot run (not root, no slurm-wlm or munge:
.ci/run installs them)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import Cluster
from cluster_jobs import experiment, server_run
from launch import ROOT, environment, train_command
from slurm_cluster import TERMINAL, Slurm, node_name

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "slurm" / "pretrain.sbatch"
JOB_S = 300
"""How long a job may take to end, requeues included (a few steps of the tiny preset)."""


@pytest.fixture
def cluster_slurm(slurm: Slurm) -> Iterator[Slurm]:
    """The session's Slurm, left as each test found it: no job, every node up."""
    yield slurm
    slurm.cancel_all()
    slurm.restore_nodes()


def submit(
    slurm: Slurm, launch_data: dict, out: Path, *args: str, nodes: str = "2", sbatch: str = ""
) -> str:
    """Submits the example script for a tiny-preset run in ``out`` tracking to the cluster's
    MLflow server, ``sbatch``'s options after the test's own; returns the job's id."""
    data = {"shards": launch_data["mono"], "spm": launch_data["spm"]}
    config = ROOT / "ds_configs" / "cpu_fp32_zero2.json"
    cmd = train_command(
        data, out, "--stage", "encoder", "--interface", "vq",
        "--tracking-uri", slurm.cluster.mlflow_uri, "--experiment", experiment(out), *args,
        config=config,
    )  # fmt: skip
    train_args = cmd[cmd.index("--deepspeed_config") + 2 :]
    cluster: Cluster = slurm.cluster
    env = cluster.environment(environment())
    env.update(PYTHON=sys.executable, DS_CONFIG=str(config))
    out.mkdir(parents=True)
    options = [
        "sbatch", "--parsable", f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1",
        "--gpus-per-node=0", "--time=10:00", f"--output={out.parent / 'slurm.out'}",
        *sbatch.split(),
    ]  # fmt: skip
    done = slurm.client([*options, str(SCRIPT), *train_args], env=env, cwd=ROOT)
    return done.stdout.strip().split(";")[0]


def log(out: Path) -> str:
    return (out.parent / "slurm.out").read_text()


def wait_end(slurm: Slurm, job: str, out: Path) -> dict[str, str]:
    try:
        return slurm.wait_job(job, lambda j: j["JobState"] in TERMINAL, JOB_S, "no end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log(out)[-4000:]}") from None


def loss_steps(out: Path) -> list[int]:
    """The step of every loss record, in the order logged: a resumed run re-logs the steps
    after its checkpoint."""
    records = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return [record["step"] for record in records if "loss" in record]


def test_a_two_node_job_trains_and_tracks_to_the_server(
    cluster_slurm: Slurm, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    job = submit(cluster_slurm, launch_data, out, "--steps", "4", "--save-interval", "2")
    ended = wait_end(cluster_slurm, job, out)
    assert ended["JobState"] == "COMPLETED", log(out)[-4000:]
    text = log(out)
    names = [node_name(host) for host in cluster_slurm.cluster.hosts]
    assert f"on n[1-2], rendezvous {names[0]}:" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert loss_steps(out) == [1, 2, 3, 4]
    # Both nodes' ranks wrote their shard of the ZeRO-2 optimizer state.
    assert len(list((out / "checkpoints" / "step-00000004").rglob("*optim_states.pt"))) == 2
    tracked = server_run(cluster_slurm.cluster, out, ("loss",))
    assert tracked["run"].info.status == "FINISHED"
    assert sorted(tracked["history"]["loss"]) == [1, 2, 3, 4]


def wait_for_step(slurm: Slurm, job: str, out: Path, step: int) -> None:
    """Returns once the job's run has logged ``step``; fails if the job ends first."""
    deadline = time.monotonic() + JOB_S
    while not (out / "metrics.jsonl").exists() or max(loss_steps(out), default=0) < step:
        state = slurm.job(job)["JobState"]
        assert state not in TERMINAL, f"job {job} {state} before step {step}:\n{log(out)[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} in {JOB_S} s:\n{log(out)[-4000:]}"
        time.sleep(0.5)


def resumed_at(out: Path) -> int:
    """The step the requeued job resumed from, as its rank 0 printed it."""
    (line,) = [line for line in log(out).splitlines() if line.startswith("resuming from ")]
    match = re.search(r"\(step (\d+)\)", line)
    assert match, line
    return int(match[1])


def test_preemption_saves_and_requeues_and_the_job_resumes_losing_no_step(
    cluster_slurm: Slurm, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    steps = 30
    job = submit(cluster_slurm, launch_data, out, "--steps", str(steps), "--save-interval", "1000")
    wait_for_step(cluster_slurm, job, out, 3)
    # Preemption's signal to the batch script: what `#SBATCH --signal=B:USR1@300` sends.
    cluster_slurm.client(["scancel", "--batch", "--signal=USR1", job])
    cluster_slurm.start_requeued(job, 1)
    ended = wait_end(cluster_slurm, job, out)
    text = log(out)
    assert ended["JobState"] == "COMPLETED", text[-4000:]
    assert ended["Restarts"] == "1", text[-4000:]
    assert "pretrain.sbatch: SIGUSR1: the ranks save a checkpoint" in text, text[-4000:]
    assert f"pretrain.sbatch: checkpoint saved; requeueing job {job}" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    saved = resumed_at(out)
    assert 3 <= saved < steps
    assert (out / "checkpoints" / f"step-{saved:08d}" / "COMPLETE").is_file()
    # The signal's checkpoint is of the step the ranks were at: no step ran twice, none lost.
    assert loss_steps(out) == list(range(1, steps + 1))
    tracked = server_run(cluster_slurm.cluster, out, ("loss",))
    assert sorted(tracked["history"]["loss"]) == list(range(1, steps + 1))
    assert tracked["run"].info.status == "FINISHED"


def test_a_job_at_its_time_limit_saves_is_requeued_resumes_and_a_cancel_saves_too(
    cluster_slurm: Slurm, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # 3 minutes, the script's SIGUSR1 45 s before their end: Slurm sends it up to a minute
    # early, so between 75 and 135 s after each start. The requeued run must log a step and
    # be cancelled before its own signal, which leaves its start a minute under load; the
    # checkpoint (a second or two) has 45 s.
    job = submit(
        cluster_slurm, launch_data, out, "--steps", "100000", "--save-interval", "100000",
        sbatch="--time=3 --signal=B:USR1@45",
    )  # fmt: skip
    cluster_slurm.start_requeued(job, 1, timeout=240)
    text = log(out)
    assert "pretrain.sbatch: SIGUSR1: the ranks save a checkpoint" in text, text[-4000:]
    assert f"pretrain.sbatch: checkpoint saved; requeueing job {job}" in text, text[-4000:]
    saved = max(loss_steps(out))
    assert (out / "checkpoints" / f"step-{saved:08d}" / "COMPLETE").is_file(), text[-4000:]
    assert loss_steps(out) == list(range(1, saved + 1))
    # The requeued job resumes from that step and trains on.
    wait_for_step(cluster_slurm, job, out, saved + 1)
    assert resumed_at(out) == saved
    # Cancelled (SIGTERM to the script and the ranks), it saves again and stays cancelled.
    cluster_slurm.client(["scancel", job])
    ended = wait_end(cluster_slurm, job, out)
    text = log(out)
    assert ended["JobState"] == "CANCELLED" and ended["Restarts"] == "1", text[-4000:]
    assert "pretrain.sbatch: SIGTERM: the ranks save a checkpoint and stop" in text, text[-4000:]
    last = max(loss_steps(out))
    # The ranks name the first signal they got: Slurm's SIGTERM or the script's SIGUSR1.
    assert re.search(rf"SIG(TERM|USR1): saved step {last} and stopping", text), text[-4000:]
    assert (out / "checkpoints" / f"step-{last:08d}" / "COMPLETE").is_file()
    assert "Traceback" not in text, text[-4000:]


def test_a_lost_node_ends_the_job_in_one_line_and_it_resumes_on_the_nodes_left(
    cluster_slurm: Slurm, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    steps = 30
    # --nodes=1-2: the job takes both nodes, and starts again on one when one is down.
    job = submit(
        cluster_slurm, launch_data, out, "--steps", str(steps), "--save-interval", "5",
        nodes="1-2",
    )  # fmt: skip
    wait_for_step(cluster_slurm, job, out, 12)
    kept, lost = cluster_slurm.cluster.hosts
    cluster_slurm.lose_node(lost)
    # What slurmctld does itself once the node missed SlurmdTimeout (minutes).
    cluster_slurm.client(
        ["scontrol", "update", f"nodename={node_name(lost)}", "state=down", "reason=lost"]
    )
    cluster_slurm.start_requeued(job, 1)
    ended = wait_end(cluster_slurm, job, out)
    text = log(out)
    assert ended["JobState"] == "COMPLETED", text[-4000:]
    assert ended["Restarts"] == "1", text[-4000:]
    assert ended["NodeList"] == node_name(kept), text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    # The job ended in one line: the kept node's rank names the lost one and the checkpoint.
    (line,) = [line for line in text.splitlines() if "train: error" in line]
    checkpoint = resumed_at(out)
    assert f"lost node {lost.address} (" in line, line
    assert f"the last complete checkpoint is {out / 'checkpoints'}/" in line, line
    assert f"(step {checkpoint})" in line, line
    # Nothing lost but the steps after that checkpoint, which the one rank left ran again.
    logged = loss_steps(out)
    restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
    assert checkpoint % 5 == 0 and logged[restart - 1] >= 12, logged
    assert logged[:restart] == list(range(1, logged[restart - 1] + 1)), logged
    assert logged[restart:] == list(range(checkpoint + 1, steps + 1)), logged
