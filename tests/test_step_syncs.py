"""A training step waits for the device only in the optimizer's overflow check.

The trainer runs in a one-process world (DeepSpeed on its CPU accelerator, as on a GPU
machine with one GPU) in a subprocess, under a dispatch mode that records every read of a
tensor's value on the host (``Tensor.item``, ``bool``/``float``/``int`` of a tensor: the
``_local_scalar_dense`` operator; ``tolist`` and ``numpy``, which on a CPU tensor skip the
dispatcher, are wrapped) with the step it happens in and the innermost project file that
calls it. On a GPU each of them makes the host wait for the device to finish everything
queued before it. Reads inside the model's forward and backward (its data-dependent sizes,
listed in tests/test_stages.py) are the model's; what is counted here is the rest of the
step: the trainer, the train units, the engine facade and DeepSpeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, check_finished, environment, launch, mlflow_run, train_command
from safetensors.torch import load_file

SCRIPT = r"""
import collections, json, sys, traceback
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, sys.argv[1])
from launch import parse_train_argv
from megasemface.distributed.engine import init_distributed, load_ds_config
from megasemface.training.trainer import Trainer

MODEL = ("/models/", "/objectives/", "/interfaces/", "/data/")
config = parse_train_argv(sys.argv[3:])
groups = init_distributed(config.mp_size)
trainer = Trainer(config, load_ds_config(sys.argv[2]), groups)
current = {"step": 0, "phase": "setup"}
reads = collections.defaultdict(collections.Counter)


def where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "megasemface" in f.filename]
    names = [f.filename for f in frames]
    if any(name.endswith("data/loading/loader.py") for name in names):
        return "loader"
    if any(part in name for name in names for part in MODEL):
        return "model"
    if not frames:
        return "backward"
    inner = traceback.extract_stack()[:-2]
    last = frames[-1]
    beyond = inner[inner.index(last) + 1 :] if last in inner else []
    if any("deepspeed" in f.filename for f in beyond):
        return "deepspeed"
    return Path(last.filename).name


def record(kind: str) -> None:
    if current["phase"] == "step":
        reads[current["step"]][f"{where()}:{kind}"] += 1


class Reads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] == "_local_scalar_dense":
            record("item")
        return func(*args, **(kwargs or {}))


for name in ("tolist", "numpy"):
    original = getattr(torch.Tensor, name)

    def wrapped(self, *a, _original=original, _name=name, **k):
        record(_name)
        return _original(self, *a, **k)

    setattr(torch.Tensor, name, wrapped)

unit_loss = trainer.unit.loss


def loss(engine, batch, generator, step):
    current.update(step=step, phase="step")
    return unit_loss(engine, batch, generator, step)


trainer.unit.loss = loss
after_step = trainer.unit.after_step


def after(engine, step, tracker):
    current["phase"] = "after"
    return after_step(engine, step, tracker)


trainer.unit.after_step = after
with Reads():
    trainer.run()
print("READS " + json.dumps({str(k): dict(v) for k, v in reads.items()}))
"""


def _step_reads(data: dict, tmp_path: Path, config: Path, *args: str) -> dict[int, dict]:
    argv = [
        "--deepspeed_config", str(config), "--data", str(data["mono"]),
        "--spm-model", str(data["spm"]), "--output-dir", str(tmp_path / "run"),
        "--preset", "tiny", "--max-tokens", "512", "--no-tracking", *args,
    ]  # fmt: skip
    env = {**environment(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "tests"), str(config), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("READS "))
    return {int(k): v for k, v in json.loads(line.removeprefix("READS ")).items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", ["cpu_fp32_zero2.json", "zero1_bf16.json", "cpu_fp32_zero3.json"]
)
def test_a_step_reads_the_device_only_in_the_optimizers_overflow_check(
    launch_data: dict, tmp_path: Path, config: str
) -> None:
    reads = _step_reads(
        launch_data,
        tmp_path,
        ROOT / "ds_configs" / config,
        "--stage", "joint", "--interface", "cl", "--cl-table", str(launch_data["cl"]),
        "--steps", "6", "--log-interval", "3", "--save-interval", "100",
    )  # fmt: skip
    assert sorted(reads) == [1, 2, 3, 4, 5, 6]
    for step, found in reads.items():
        if step < 3:  # ZeRO-3 records and checks its parameters' fetch order at first
            continue
        # The model's reads (tests/test_stages.py) and the loader's batch, in host memory.
        loop = {k: v for k, v in found.items() if not k.startswith(("model:", "loader:"))}
        if step % 3:
            assert loop == {"deepspeed:item": 1}, (step, found)
        else:  # a logging step reads the ledger once, then the logged figures
            assert loop["step_ledger.py:tolist"] == 1 and loop["deepspeed:item"] == 1, found


@pytest.mark.launcher
def test_a_non_finite_loss_changes_nothing_on_any_rank(launch_data: dict, tmp_path: Path) -> None:
    """Step 2's loss is NaN on both ranks and no step before the 4th reads the device: the
    optimizer's own check skips it, so the weights after it are those after step 1, and the
    steps around it train; the ledger counts the skip when the 4th step reads it."""
    out = tmp_path / "run"
    cmd = train_command(
        {"shards": launch_data["mono"], "spm": launch_data["spm"]},
        out,
        "--stage", "encoder", "--interface", "none", "--steps", "4", "--log-interval", "4",
        "--save-interval", "1", "--keep-last", "4", "--inject-nan-at", "2",
        config=ROOT / "ds_configs" / "cpu_fp32_zero2.json",
        live=True,
    )  # fmt: skip
    check_finished(launch(cmd), out, 4)
    live = [load_file(str(out / "live" / f"step-{s:08d}-mp0.safetensors")) for s in (1, 2, 3)]
    assert all(torch.equal(live[0][k], live[1][k]) for k in live[0])
    assert not all(torch.equal(live[1][k], live[2][k]) for k in live[1])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2]
    assert mlflow_run(out)[1].data.metrics["skipped_steps"] == 1
