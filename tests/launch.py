"""Launching real training runs from tests: N CPU ranks over gloo, started by the launcher
the pipeline uses (``python -m megasemface.distributed.launch``), or by DeepSpeed's
(``deepspeed --num_accelerators N``) where a test asks for it.

Most tests start their runs with the pipeline's launcher: DeepSpeed's runs two more Python
processes that import DeepSpeed (about 10 s of CPU a run on a 2-core machine) before the
ranks start, and the ranks are the same. tests/test_train_launcher.py checks that both give
the same run bit for bit and runs its own tests through DeepSpeed's.

Imported by tests for the helpers; run by the launcher as a script, it is ``train.py`` with
two additions: at every checkpoint the ranks of data-parallel rank 0 also write the weights
their live model holds (gathered under ZeRO-3) to
``<output-dir>/live/step-NNNNNNNN-mp<R>.safetensors``, which tests compare with what the
checkpoint tools reconstruct from DeepSpeed's files; and several runs, their arguments
separated by ``--then``, run one after another in the same ranks (:func:`chain`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megasemface.distributed.launch import free_port

if TYPE_CHECKING:
    from megasemface.training.options import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
SHIPPED_CONFIGS = {
    2: ROOT / "ds_configs" / "cpu_fp32_zero2.json",
    3: ROOT / "ds_configs" / "cpu_fp32_zero3.json",
}


def on_cuda(*values: Any) -> Any:
    """A ``pytest.mark.parametrize`` case that needs a CUDA device: in the GPU tier (marked
    ``gpu``), skipped without one."""
    import pytest
    import torch

    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.param(*values, marks=[pytest.mark.gpu, needs])


def ds_config(zero: int, directory: Path) -> Path:
    """An fp32 CPU DeepSpeed config for ZeRO stage ``zero`` (exact arithmetic for tests):
    the shipped one for 2 and 3, the ZeRO-2 one with ``stage`` 1 for 1."""
    if zero in SHIPPED_CONFIGS:
        return SHIPPED_CONFIGS[zero]
    config = json.loads(SHIPPED_CONFIGS[2].read_text(encoding="utf-8"))
    config["zero_optimization"]["stage"] = zero
    path = directory / f"cpu_fp32_zero{zero}.json"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


def environment() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def train_command(
    data: dict[str, Any],
    out: Path,
    *args: str,
    config: Path,
    procs: int = 2,
    live: bool = False,
    deepspeed: bool = False,
) -> list[str]:
    """train.py (or, with ``live``, this file) on the tiny preset, its ranks started by
    megasemface's launcher of one machine's ranks (what the pipeline runs), or with
    ``deepspeed`` by DeepSpeed's launcher."""
    script = Path(__file__) if live else ROOT / "megasemface" / "train.py"
    launcher = (
        [str(DEEPSPEED), "--num_accelerators", str(procs)]
        if deepspeed
        else [sys.executable, "-m", "megasemface.distributed.launch", "--nproc", str(procs)]
    )
    return [
        *launcher,
        "--master_port",
        str(free_port()),
        str(script),
        "--deepspeed_config",
        str(config),
        "--data",
        str(data["shards"]),
        "--spm-model",
        str(data["spm"]),
        "--output-dir",
        str(out),
        "--preset",
        "tiny",
        "--max-tokens",
        "512",
        "--log-interval",
        "1",
        *args,
    ]


def parse_train_argv(argv: list[str]) -> TrainConfig:
    """The TrainConfig train.py makes of ``argv`` (its own parser)."""
    from megasemface.train import build_parser
    from megasemface.training.options import train_config_from_args

    return train_config_from_args(build_parser().parse_args(argv))


def launch(
    cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` in the tests' environment, with ``env`` on top of it."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**environment(), **(env or {})},
        cwd=ROOT,
        timeout=timeout,
    )


def check_finished(result: subprocess.CompletedProcess[str], out: Path, steps: int) -> None:
    """The run exited 0 and its last checkpoint is complete."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (out / "checkpoints" / f"step-{steps:08d}" / "COMPLETE").is_file()


def losses(out: Path) -> dict[int, float]:
    """Per-step losses of a run's metrics.jsonl (a resumed run re-logs the steps after its
    checkpoint: the last record of a step wins)."""
    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def mlflow_run(out: Path) -> tuple[Any, Any]:
    """(MLflow client, the one run) of a launched run's own store, ``<out>/mlflow.db``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    return client, run


def rewind(reference: Path, out: Path, step: int) -> None:
    """Makes ``out`` a copy of the finished run ``reference`` as it stood once its checkpoint
    of ``step`` was complete: the later checkpoints removed, ``latest`` naming ``step``, the
    per-step records (metrics, sample ids) cut after it. What :func:`kill_after_checkpoint`
    leaves, without running the run again: for tests of what a resume does, where an
    uninterrupted reference is run anyway (the kill itself is tested on its own)."""
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    tag = f"step-{step:08d}"
    assert (checkpoints / tag / "COMPLETE").is_file(), f"{reference} has no checkpoint {tag}"
    for later in checkpoints.glob("step-*"):
        if later.name > tag:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(tag)
    for records in [out / "metrics.jsonl", *out.glob("samples-rank*.jsonl")]:
        if records.is_file():
            lines = records.read_text().splitlines()
            kept = [x for x in lines if json.loads(x).get("step", 0) <= step]
            records.write_text("".join(x + "\n" for x in kept))


def kill_after_checkpoint(cmd: list[str], out: Path, step: int, timeout: float = 240) -> None:
    """Starts ``cmd`` and SIGKILLs the launcher and every rank once the checkpoint of ``step``
    is complete (no goodbye: what a preempted or crashed job leaves)."""
    proc = subprocess.Popen(
        cmd,
        env=environment(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = out / "checkpoints" / f"step-{step:08d}" / "COMPLETE"
    deadline = time.monotonic() + timeout
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), f"no complete checkpoint of step {step} before the kill"


def _live_trainer() -> type:
    import torch
    from safetensors.torch import save_file

    from megasemface.training.trainer import Trainer

    class LiveTrainer(Trainer):
        """The trainer, writing its live weights beside every checkpoint."""

        def save(self) -> float:
            blocked = super().save()
            module = self.engine.module
            with self.engine.gathered(module.parameters()):  # a collective under ZeRO-3
                if self.groups.dp_rank == 0:
                    state = {
                        name: tensor.detach().to(torch.float32).clone()
                        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
                    }
                    live = self.config.output_dir / "live"
                    live.mkdir(exist_ok=True)
                    name = f"step-{self.step:08d}-mp{self.groups.mp_rank}.safetensors"
                    save_file(state, str(live / name))
            return blocked

    return LiveTrainer


RUN_SEPARATOR = "--then"
"""Separates the runs of one launch (:func:`chain`)."""


def chain(commands: list[list[str]]) -> list[str]:
    """One launch that runs the runs of ``commands`` (each from :func:`train_command` with
    ``live``, on the same launcher and number of ranks) one after another in the same ranks.

    For tests of many short runs: a rank's start (imports, DeepSpeed's and torch's first-use
    setup) costs several times a 3-step run's training on a 2-core machine. The runs of one
    launch are as independent as runs of their own: each seeds its model, and each step's
    draws, from its own seed (tests/test_stage_losses.py compares them with losses recorded
    from one launch per run)."""
    script = str(Path(__file__))
    joined = list(commands[0])
    for cmd in commands[1:]:
        joined += [RUN_SEPARATOR, *cmd[cmd.index(script) + 1 :]]  # the first's launcher
    return joined


def launch_chains(
    groups: list[list[str]],
    command: Callable[[str], list[str]],
    finished: Callable[[str], tuple[Path, int]],
    timeout: float = 600,
) -> None:
    """Launches each group of named runs as one :func:`chain`, the launches side by side (a
    2-core machine's ranks are idle for much of a rank's start), and checks that every run
    finished: ``command(name)`` is a run's command, ``finished(name)`` its output folder and
    last step."""

    def run(names: list[str]) -> None:
        result = launch(chain([command(name) for name in names]), timeout=timeout)
        for name in names:
            check_finished(result, *finished(name))

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        for done in [pool.submit(run, names) for names in groups]:
            done.result()


def main() -> int:
    """train.py's main with :class:`LiveTrainer`, for each run of the command line (their
    arguments separated by ``--then``, see :func:`chain`); run by a launcher."""
    from megasemface.distributed.engine import init_distributed, load_ds_config
    from megasemface.train import build_parser
    from megasemface.training.options import train_config_from_args

    runs: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == RUN_SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    groups = None
    for argv in runs:
        args, _ = build_parser().parse_known_args(argv)
        config = train_config_from_args(args)
        ds = load_ds_config(args.deepspeed_config)
        groups = groups or init_distributed(config.mp_size)
        assert groups.mp_size == config.mp_size, "the runs of one launch share their groups"
        status = _live_trainer()(config, ds, groups).run()
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    from megasemface.distributed.engine import end_process

    end_process(main())
