"""Running ``megasemface/train.py`` through DeepSpeed's launcher from the pipeline.

The launcher's own output (DeepSpeed's start-up logs of every rank) goes to
``<run>/launcher.log``; the terminal shows the trainer's progress lines, so a long pipeline
reads as a list of steps with live progress rather than pages of logs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megasemface.checkpoints.layout import MARKER, checkpoint_tag
from megasemface.training.options import TrainConfig, train_argv

__all__ = ["LaunchError", "deepspeed_command", "run_logged", "training_complete"]

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
_SHOWN = ("step ", "validation", "resuming", "train: error", "Traceback", "Error", "error:")


class LaunchError(RuntimeError):
    """A pipeline step's subprocess failed; the message names its log."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def default_ds_config() -> Path:
    name = "zero2_bf16.json" if _gpu() else "cpu_fp32_zero2.json"
    return ROOT / "ds_configs" / name


def deepspeed_command(
    config: TrainConfig, *, ds_config: Path, procs: int, hostfile: Path | None = None
) -> list[str]:
    """``deepspeed [--hostfile H | --num_accelerators N] --master_port P train.py
    --deepspeed_config D ARGS``, ARGS the command line of ``config`` (``train_argv``)."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    placement = ["--hostfile", str(hostfile)] if hostfile else ["--num_accelerators", str(procs)]
    return [
        launcher,
        *placement,
        "--master_port",
        str(_free_port()),
        str(TRAIN_SCRIPT),
        "--deepspeed_config",
        str(ds_config),
        *train_argv(config),
    ]


def launch_environment(procs: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not _gpu():
        env.setdefault("DS_ACCELERATOR", "cpu")
        # Each rank gets its share of the cores: oversubscribed threads thrash.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    return env


def run_logged(
    cmd: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    show: tuple[str, ...] = _SHOWN,
    indent: str = "   ",
) -> float:
    """Runs ``cmd``, writing all its output to ``log_path`` and echoing the lines that
    contain one of ``show``; returns the seconds it took. Raises LaunchError on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        process = subprocess.Popen(
            list(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            cwd=ROOT,
        )
        assert process.stdout is not None
        tail: list[str] = []
        for line in process.stdout:
            log.write(line)
            log.flush()  # the log is where a user looks while a run is going
            tail = [*tail[-39:], line]
            text = line.rstrip()
            # The launcher prefixes rank output with "[rank0]:" on some versions.
            stripped = text.split("]:", 1)[-1].strip() if text.startswith("[rank") else text
            if any(key in stripped for key in show):
                print(f"{indent}{stripped}", flush=True)
        code = process.wait()
    if code != 0:
        raise LaunchError(
            f"exit code {code}; the full output is in {log_path}. Its last lines:\n"
            + "".join(tail[-15:])
        )
    return time.perf_counter() - started


def training_complete(run_dir: Path, steps: int) -> bool:
    """The run's final checkpoint is complete (train.py writes its marker last)."""
    return (run_dir / "checkpoints" / checkpoint_tag(steps) / MARKER).is_file()
