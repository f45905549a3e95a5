"""Checkpoints under a crash in the middle of a save, a full disk and a hostile file.

Through the pipeline's launcher (2 CPU processes over gloo, ZeRO-2 fp32, the tiny
preset): a run killed after DeepSpeed wrote its files but before ``COMPLETE``, and a run
whose disk fills up during a save, both resume from the previous complete checkpoint and
then repeat an uninterrupted run's losses exactly; a model-state file replaced by a pickle
that would run code is refused, by a resumed run and by the checkpoint tools, before
DeepSpeed's loader opens it. Besides, DeepSpeed's own files of every ZeRO stage in fp32
and bf16 pass the safe loader and load back (one process, no launcher).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launch import ROOT, environment, launch, losses, train_command

from megasemface.checkpoints.manager import FAULT_KILL_AT_SAVE

pytestmark = pytest.mark.slow

CONFIG = ROOT / "ds_configs" / "cpu_fp32_zero2.json"
LIMIT = 600
"""Seconds a launch may take (a busy machine runs the tiny runs slowly)."""
ARGS = ["--stage", "joint", "--interface", "vq", "--steps", "4", "--save-interval", "2"]


@pytest.fixture(scope="module")
def data(launch_data: dict) -> dict:
    return {"shards": launch_data["mono"], "spm": launch_data["spm"]}


def command(data: dict, out: Path) -> list[str]:
    return train_command(data, out, *ARGS, "--no-tracking", config=CONFIG)


def tag(step: int) -> str:
    return f"step-{step:08d}"


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("train: error")]


def check_resumed_exactly(
    result: subprocess.CompletedProcess[str], out: Path, reference: Path
) -> None:
    """The run resumed from step 2, finished, and its losses are the uninterrupted run's."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / tag(2)} (step 2)" in result.stdout
    assert (out / "checkpoints" / tag(4) / "COMPLETE").is_file()
    assert (out / "checkpoints" / "latest").read_text() == tag(4)
    assert losses(out) == losses(reference)  # identical, not just close


@pytest.fixture(scope="module")
def reference(data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: checkpoints of steps 2 and 4."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = launch(command(data, out), timeout=LIMIT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3, 4]
    return out


@pytest.mark.launcher
def test_killed_while_saving_resumes_from_the_previous_checkpoint(
    data: dict, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cmd = command(data, out)
    env = {**environment(), FAULT_KILL_AT_SAVE: "4:0"}
    killed = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=LIMIT)
    assert killed.returncode != 0
    half = out / "checkpoints" / tag(4)
    # Killed after DeepSpeed wrote every rank's files, before the checkpoint was complete.
    assert (half / "mp_rank_00_model_states.pt").is_file()
    assert not (half / "COMPLETE").exists()
    assert (out / "checkpoints" / tag(2) / "COMPLETE").is_file()
    assert (out / "checkpoints" / "latest").read_text() == tag(2)
    (half / "left-by-the-killed-run").write_text("")

    result = launch(cmd, timeout=LIMIT)
    check_resumed_exactly(result, out, reference)
    # The next save of step 4 replaced the half-written folder instead of writing into it.
    names = {p.name for p in half.iterdir()}
    assert names == {p.name for p in (reference / "checkpoints" / tag(4)).iterdir()}


@pytest.mark.launcher
def test_full_disk_while_saving_stops_cleanly_and_resumes(
    data: dict, reference: Path, tmpfs: Callable[[int], Path]
) -> None:
    checkpoint = sum(f.stat().st_size for f in (reference / "checkpoints" / tag(2)).iterdir())
    # Room for the first checkpoint and the run's small files, not for a second checkpoint.
    size = checkpoint * 3 // 2 + (512 << 10)
    disk = tmpfs(size)
    out = disk / "run"
    result = launch(command(data, out), timeout=LIMIT)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # One line from each rank whose own write failed (a rank whose barrier broke because
    # the other stopped says nothing): usually one, two when both filled the disk at once.
    lines = {re.sub(r"^train: error \(rank \d+\): ", "", x) for x in error_lines(result)}
    assert len(lines) == 1, result.stderr[-3000:]
    [line] = lines
    assert line.startswith(f"checkpoint {out / 'checkpoints' / tag(4)} (step 4) could not")
    assert "the disk is full" in line and f"{tag(2)} is intact" in line
    assert (out / "checkpoints" / tag(2) / "COMPLETE").is_file()
    assert not (out / "checkpoints" / tag(4) / "COMPLETE").exists()
    assert (out / "checkpoints" / "latest").read_text() == tag(2)

    # Space freed: the same command resumes from step 2 and repeats the reference exactly.
    subprocess.run(["mount", "-o", f"remount,size={size + 4 * checkpoint}", str(disk)], check=True)
    check_resumed_exactly(launch(command(data, out), timeout=LIMIT), out, reference)


class Payload:
    """Pickles as a call to ``Path.touch(marker)``: what an unpickler that runs code does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


@pytest.mark.launcher
def test_a_model_states_file_that_would_run_code_is_never_loaded(
    data: dict, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megasemface.cli.merge_checkpoints import main as merge_checkpoints

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    hostile = out / "checkpoints" / tag(4) / "mp_rank_00_model_states.pt"
    marker = tmp_path / "code-ran"
    # The payload does run under an unsafe load.
    torch.save({"module": Payload(tmp_path / "probe")}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert (tmp_path / "probe").exists()
    torch.save({"module": Payload(marker)}, hostile)

    result = launch(command(data, out), timeout=LIMIT)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = error_lines(result)
    assert str(hostile) in line and "safe loader" in line and "use another checkpoint" in line
    assert "resuming from" not in result.stdout
    assert not marker.exists()

    assert merge_checkpoints(["consolidate", str(out), "--out", str(tmp_path / "model")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(hostile) in line and "safe loader" in line
    assert not marker.exists()
    assert not (tmp_path / "model").exists()


ROUND_TRIP = """
import json, sys
from pathlib import Path
import torch
from torch import nn
from megasemface.distributed.engine import (
    DeepSpeedEngine, init_distributed, load_ds_config, unsafe_checkpoint_file,
)

groups = init_distributed(1)
config_path, root = Path(sys.argv[1]), Path(sys.argv[2])
results = {}
for zero in (1, 2, 3):
    for bf16 in (False, True):
        name = f"zero{zero}" + ("-bf16" if bf16 else "")
        config = load_ds_config(config_path)
        config["zero_optimization"]["stage"] = zero
        if bf16:
            config["bf16"] = {"enabled": True}
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        engine = DeepSpeedEngine(model, config, groups, list(model.parameters()))
        x = torch.randn(3, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
        engine.backward(engine.forward(x).float().pow(2).mean())
        engine.step()
        engine.save(root / name, "step-00000001", {"step": 1})
        problem = unsafe_checkpoint_file(root / name / "step-00000001")
        files = sorted(p.name for p in (root / name / "step-00000001").glob("*.pt"))
        state = engine.load(root / name, "step-00000001")
        results[name] = {"problem": problem, "files": files, "step": state.get("step")}
print("RESULTS " + json.dumps(results))
"""


def test_deepspeeds_own_files_pass_the_safe_loader_and_load_back(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ROUND_TRIP), str(CONFIG), str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert sorted(results) == sorted(f"zero{z}{s}" for z in (1, 2, 3) for s in ("", "-bf16"))
    for name, found in results.items():
        assert found["problem"] is None, (name, found["problem"])
        assert any("optim_states" in f for f in found["files"]), (name, found["files"])
        assert found["step"] == 1, name
