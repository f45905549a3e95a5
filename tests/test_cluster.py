"""The README's multi-node command on a simulated cluster (tests/cluster.py): 2 nodes, each a
network namespace running sshd, DeepSpeed's runner starting one CPU rank on each over pdsh
and ssh, gloo between them over veth links, and a real ``mlflow server`` on a host of its
own. Skipped where namespaces cannot be made (not root, no ``ip netns``, no sshd or pdsh:
.ci/run installs them, docs/development.md names them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Cluster
from cluster_jobs import STEPS, error_lines, readme_command, run_on_first_node, server_run
from launch import ROOT, check_finished, launch, losses, train_command

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


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

    tracked = server_run(nodes, out)
    run = tracked["run"]
    assert run.info.status == "FINISHED"
    assert run.data.params, "no params on the server"
    loss_keys = [key for key in tracked["history"] if key.endswith("loss")]
    assert loss_keys, sorted(tracked["history"])
    assert sorted(tracked["history"][loss_keys[0]]) == list(range(1, STEPS + 1))
    # Artifacts went through the server's proxy into its store, not the run's directory.
    assert "config.json" in tracked["artifacts"]
    assert list((nodes.root / "mlflow" / "artifacts").rglob("config.json"))

    # The same global batch from 2 ranks of one node (DeepSpeed's own launcher, gloo over
    # the loopback): the same losses to the bit, as docs/pretraining.md says.
    one_node = tmp_path / "one-node"
    data = {"shards": launch_data["mono"], "spm": launch_data["spm"]}
    args = ("--stage", "encoder", "--interface", "vq", "--steps", str(STEPS))
    config = ROOT / "ds_configs" / "cpu_fp32_zero2.json"
    check_finished(
        launch(train_command(data, one_node, *args, config=config, deepspeed=True)), one_node, STEPS
    )
    assert losses(one_node) == losses(out)


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
