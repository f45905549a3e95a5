"""The rank environment of an srun task (distributed/slurm.py), from the variables Slurm
22.05 gives a task of ``srun --nodes=2 --ntasks-per-node=...`` (read from a real job on
the simulated Slurm cluster of tests/slurm_cluster.py)."""

from __future__ import annotations

import pytest

from megasemface.distributed.slurm import srun_rank_environment, tasks_per_node

RENDEZVOUS = {"MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


def srun_task(procid: int, nodeid: int, localid: int, per_node: str, tasks: int) -> dict:
    return {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        **RENDEZVOUS,
    }


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("1(x2)", [1, 1]), ("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("4,3(x2)", [4, 3, 3])],
)
def test_slurms_compressed_task_counts_expand_one_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts


def test_each_srun_task_is_the_rank_slurm_numbered() -> None:
    # 3 nodes, 2 + 2 + 1 tasks: the 4th task is the second of the second node.
    env = srun_task(procid=3, nodeid=1, localid=1, per_node="2(x2),1", tasks=5)
    assert srun_rank_environment(env) == {
        "RANK": "3",
        "WORLD_SIZE": "5",
        "LOCAL_RANK": "1",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "3",
    }


def test_the_batch_scripts_own_shell_and_a_launchers_ranks_are_left_alone() -> None:
    task = srun_task(procid=0, nodeid=0, localid=0, per_node="1(x2)", tasks=2)
    # The batch shell: SLURM_PROCID and SLURM_NTASKS, but no job step.
    batch = {k: v for k, v in task.items() if not k.startswith("SLURM_STEP")}
    assert srun_rank_environment(batch) == {}
    # `deepspeed` run inside a job step already numbered its ranks.
    assert srun_rank_environment({**task, "RANK": "5"}) == {}
    assert srun_rank_environment({}) == {}


def test_an_srun_task_without_the_rendezvous_stops_in_one_line_naming_the_fix() -> None:
    env = srun_task(procid=0, nodeid=0, localid=0, per_node="1(x2)", tasks=2)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    with pytest.raises(ValueError, match=r"^MASTER_ADDR and MASTER_PORT not set .*pretrain.sbatch"):
        srun_rank_environment(env)
    with pytest.raises(ValueError, match="not Slurm's task count list"):
        srun_rank_environment({**env, **RENDEZVOUS, "SLURM_STEP_TASKS_PER_NODE": "two"})
