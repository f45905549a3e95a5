"""Running ``megasemface/train.py`` on its ranks from the pipeline.

The launcher's own output (DeepSpeed's start-up logs of every rank) goes to
``<run>/launcher.log``; the terminal shows the trainer's progress lines, so a long pipeline
reads as a list of steps with live progress rather than pages of logs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megasemface.checkpoints.layout import (
    MARKER,
    checkpoint_tag,
    complete_checkpoints,
    is_model_dir,
)
from megasemface.distributed.launch import free_port
from megasemface.training.options import TrainConfig, train_argv

__all__ = [
    "LaunchError",
    "changed_settings",
    "launch_command",
    "lineage",
    "run_logged",
    "training_complete",
]

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
_SHOWN = ("step ", "validation", "resuming", "train: error", "Traceback", "Error", "error:")


class LaunchError(RuntimeError):
    """A pipeline step's subprocess failed; the message names its log."""


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def default_ds_config() -> Path:
    name = "zero2_bf16.json" if _gpu() else "cpu_fp32_zero2.json"
    return ROOT / "ds_configs" / name


def launch_command(
    config: TrainConfig, *, ds_config: Path, procs: int, hostfile: Path | None = None
) -> list[str]:
    """The command that runs ``train.py --deepspeed_config D ARGS`` (ARGS the command line
    of ``config``, ``train_argv``) on ``procs`` ranks of this machine, or over the machines
    of ``hostfile`` through ``deepspeed --hostfile H``.

    One machine goes through ``megasemface.distributed.launch``, which gives the ranks the
    environment DeepSpeed's launcher gives them without importing DeepSpeed twice more
    before they start: on a small machine those imports take longer than a short run's
    training, and a pipeline launches many runs.
    """
    script = [str(TRAIN_SCRIPT), "--deepspeed_config", str(ds_config), *train_argv(config)]
    port = ["--master_port", str(free_port())]
    if hostfile is None:
        return [
            sys.executable,
            "-m",
            "megasemface.distributed.launch",
            "--nproc",
            str(procs),
            *port,
            *script,
        ]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    return [launcher, "--hostfile", str(hostfile), *port, *script]


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


# Settings that name, log or pace a run, or say how it is computed, without changing what it
# computes: a finished run is reused whatever they are.
_NOT_RESULTS = frozenset(
    {
        "output_dir",
        "experiment",
        "run_name",
        "tracking_uri",
        "no_tracking",
        "tags",
        "register_model",
        "log_interval",
        "log_sample_ids",
        "codebook_warn_fraction",
        "save_interval",
        "keep_last",
        "max_consecutive_skips",
        "num_workers",
        "compile",
        "steps",  # a longer run continues a shorter one
    }
)


def changed_settings(run_dir: Path, config: TrainConfig) -> list[str]:
    """What ``config`` changes in the settings the run in ``run_dir`` was started with, one
    ``name: recorded -> wanted`` each; empty for a run not started yet or started alike.

    The pipeline reuses a finished run and resumes an unfinished one: either is only right
    for the same settings, or a changed option would silently come back with the old
    results. Settings that do not change what a run computes are not compared (names,
    logging, checkpoint pacing, compilation, the number of steps). A setting the record
    lacks (a run of an earlier version) counts as its default. Paths inside the work
    directory are compared relative to it, so that a moved work directory is still reused.

    Raises:
        LaunchError: the run's record (``config.json``) cannot be read.
    """
    path = run_dir / "config.json"
    if not path.is_file():
        return []
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["train"]
        old_root = Path(recorded["output_dir"]).parent.parent
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise LaunchError(
            f"{path} is not a readable run record ({exc}); remove {run_dir} to train it again"
        ) from exc
    new_root = Path(config.output_dir).parent.parent

    def relocated(value: object) -> object:
        if isinstance(value, list):
            return [relocated(item) for item in value]
        if isinstance(value, str) and value.startswith(f"{old_root}/"):
            return f"{new_root}{value[len(str(old_root)) :]}"
        return value

    defaults = {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(TrainConfig)
    }
    # Filled in by stage since; runs recorded before the options existed read the
    # extractor and the table's rows as they are.
    defaults["decoder_codes"] = "extractor"
    defaults["cl_unit_logits"] = False
    defaults["cl_unit_mse"] = False
    defaults["cl_table_input"] = False
    defaults["decoder_memory_norm"] = False
    defaults["decoder_continuous"] = 0.0
    defaults["language_mean_weight"] = 0.0
    changes = []
    for name, wanted in config.to_dict().items():
        if name in _NOT_RESULTS:
            continue
        before = relocated(recorded[name]) if name in recorded else defaults[name]
        if before != wanted:
            changes.append(f"{name}: {before!r} -> {wanted!r}")
    return changes


def lineage(path: Path) -> tuple[str | None, dict[str, str]]:
    """The MLflow run and the parent runs recorded in ``path``: a run directory (its newest
    complete checkpoint; ``(None, {})`` before the first) or a model directory (no run of
    its own). What the pipeline checks a reused step against its inputs with.

    Raises:
        LaunchError: the record (the model's ``config.json``, the checkpoint's ``meta.json``)
            cannot be read.
    """
    if is_model_dir(path):
        record = path / "config.json"
    elif (path / "checkpoints").is_dir() and (done := complete_checkpoints(path)):
        record = done[-1] / "meta.json"
    else:
        return None, {}
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
        meta = (data.get("meta") or {}) if record.name == "config.json" else data
        return meta.get("mlflow_run_id"), dict(meta.get("parent_runs") or {})
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError) as exc:
        raise LaunchError(
            f"{record} is not a readable record of {path} ({exc}); remove {path} to make it again"
        ) from exc
