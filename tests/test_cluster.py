"""The README's multi-node command on a simulated cluster (tests/cluster.py): 2 nodes, each a
network namespace running sshd, DeepSpeed's runner starting one CPU rank on each over pdsh
and ssh, gloo between them over veth links, and a real ``mlflow server`` on a host of its
own. Skipped where namespaces cannot be made (not root, no ``ip netns``, no sshd or pdsh:
.ci/run installs them, docs/development.md names them)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, cluster, in_namespace, unavailable
from launch import DEEPSPEED, ROOT, environment, losses, train_command

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

STEPS = 4
EXPERIMENT = "cluster"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """2 nodes with sshd and an MLflow server host, torn down after the module's tests."""
    reason = unavailable()
    if reason:
        pytest.skip(f"no simulated cluster: {reason}")
    with cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made


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
        EXPERIMENT,
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
    proc = up.popen(
        up.hosts[0],
        cmd,
        up.environment(environment()),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        up.stop(proc)  # type: ignore[arg-type]
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out:\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def server_run(up: Cluster) -> dict[str, Any]:
    """What the MLflow server holds of the experiment's one run, read with the client."""
    assert up.mlflow is not None

    def read() -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=up.mlflow_uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        (run,) = client.search_runs([experiment.experiment_id])
        history = {
            key: [m.step for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
        return {"run": run, "history": history, "artifacts": artifacts}

    return in_namespace(up.mlflow.name, read)


def test_the_readmes_two_node_command_trains_and_tracks_to_the_server(
    nodes: Cluster, launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"  # the namespaces share the machine's filesystem
    cmd = readme_command(nodes, launch_data, out, "--steps", str(STEPS), "--save-interval", "2")
    result = run_on_first_node(nodes, cmd)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # pdsh prefixes each node's output with the node's address: both nodes ran a rank.
    for host in nodes.hosts:
        assert f"{host.address}: " in result.stdout + result.stderr
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    for step in (2, STEPS):
        assert (out / "checkpoints" / f"step-{step:08d}" / "COMPLETE").is_file()
    # Both ranks wrote their shard of the ZeRO-2 optimizer state.
    optimizer = sorted((out / "checkpoints" / f"step-{STEPS:08d}").rglob("*optim_states.pt"))
    assert len(optimizer) == 2, optimizer

    tracked = server_run(nodes)
    run = tracked["run"]
    assert run.info.status == "FINISHED"
    assert run.data.params, "no params on the server"
    loss_keys = [key for key in tracked["history"] if key.endswith("loss")]
    assert loss_keys, sorted(tracked["history"])
    assert sorted(tracked["history"][loss_keys[0]]) == list(range(1, STEPS + 1))
    # Artifacts went through the server's proxy into its store, not the run's directory.
    assert "config.json" in tracked["artifacts"]
    assert list((nodes.root / "mlflow" / "artifacts").rglob("config.json"))


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """megasemface's own error lines (pdsh prefixes them with the node's address)."""
    text = result.stdout + result.stderr
    return [line for line in text.splitlines() if "train: error" in line]


def test_an_unreachable_tracking_server_stops_the_start_in_one_line(
    nodes: Cluster, launch_data: dict, tmp_path: Path
) -> None:
    assert nodes.mlflow is not None
    out = tmp_path / "run"
    cmd = readme_command(nodes, launch_data, out, "--steps", str(STEPS))
    wrong = f"http://{nodes.mlflow.address}:5999"  # the server's host; nothing on the port
    cmd[cmd.index(nodes.mlflow_uri)] = wrong
    result = run_on_first_node(nodes, cmd)
    assert result.returncode != 0
    (line,) = error_lines(result)
    assert f"MLflow tracking server {wrong} is unreachable" in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (out / "metrics.jsonl").exists()  # no step was taken
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("fault", ["no-sshd", "wrong-address"])
def test_an_unreachable_node_stops_the_start_in_one_line_naming_it(
    nodes: Cluster, launch_data: dict, tmp_path: Path, fault: str
) -> None:
    assert nodes.mlflow is not None
    # The MLflow host is up but runs no sshd; .77 is on the subnet but no host has it.
    lost = nodes.mlflow.address if fault == "no-sshd" else nodes.mlflow.address[:-3] + "77"
    hostfile = nodes.hostfile(addresses=[nodes.hosts[0].address, lost])
    out = tmp_path / "run"
    cmd = readme_command(nodes, launch_data, out, "--steps", str(STEPS), hostfile=hostfile)
    result = run_on_first_node(nodes, cmd, timeout=120)
    assert result.returncode != 0
    (line,) = error_lines(result)
    assert f"cannot reach node {lost} " in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (out / "metrics.jsonl").exists()
