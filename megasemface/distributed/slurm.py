"""The rank environment of a task that Slurm's ``srun`` started.

``srun`` starts one process per task and describes it in ``SLURM_*`` variables; DeepSpeed
(``deepspeed.init_distributed``) reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``, the variables its own launcher sets, and without them
looks for MPI. :func:`srun_rank_environment` maps the first onto the second, so that ``srun
python megasemface/train.py ...`` needs no launcher in between. The rendezvous address and
port are the same for every task and come from the batch script
(examples/slurm/pretrain.sbatch), which sets them once for the job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["srun_rank_environment", "tasks_per_node"]


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts (``SLURM_STEP_TASKS_PER_NODE``), one per node:
    ``"2(x3),1"`` is ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not Slurm's task count list")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def srun_rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables DeepSpeed reads, for the srun task that ``env`` describes; nothing when
    ``env`` is not an srun task's (a batch script's own shell has SLURM_PROCID but no job
    step) or when a launcher already set ``RANK`` (``deepspeed`` inside a Slurm job)."""
    if "RANK" in env or "SLURM_STEP_NUM_TASKS" not in env:
        return {}
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} not set in this srun task: export them in the batch "
            "script before srun, the first node's host name and a free port "
            "(examples/slurm/pretrain.sbatch does)"
        )
    per_node = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "LOCAL_SIZE": str(per_node[int(env["SLURM_NODEID"])]),
        "CROSS_RANK": env["SLURM_NODEID"],
        "CROSS_SIZE": str(len(per_node)),
    }
