"""A third interface, defined outside the package (tests/toy_interface.py) and registered
through ``MEGASEMFACE_PLUGINS``: train.py trains it, and every tool that reads a checkpoint
reads its checkpoints, without a line of the package that names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, check_finished, ds_config, environment, launch, train_command
from safetensors.torch import load_file
from toy_interface import NAME

from megasemface.checkpoints import load_stage
from megasemface.interfaces.base import tensor_sha256
from megasemface.models.model_dir import read_model_dir_info

PLUGIN = {
    "MEGASEMFACE_PLUGINS": "toy_interface_plugin",
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
    ),
}
STEPS = 4


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env={**environment(), **PLUGIN},
        cwd=ROOT,
        timeout=300,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def toy_run(launch_data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The joint stage of the toy interface, two ranks under ZeRO-2, a checkpoint a step."""
    out = tmp_path_factory.mktemp("toy") / "run"
    data = {"shards": launch_data["mono"], "spm": launch_data["spm"]}
    args = ("--stage", "joint", "--interface", NAME, "--steps", str(STEPS))
    args += ("--save-interval", "1", "--keep-last", str(STEPS), "--no-tracking")
    cmd = train_command(data, out, *args, config=ds_config(2, out.parent))
    check_finished(launch(cmd, env=PLUGIN), out, STEPS)
    return out


@pytest.mark.launcher
def test_a_third_interface_trains_and_every_checkpoint_tool_reads_it(
    toy_run: Path, launch_data: dict, tmp_path: Path
) -> None:
    state, meta = load_stage(toy_run)
    assert meta["interface"]["kind"] == NAME
    assert "interface.table.weight" in state
    records = [json.loads(x) for x in (toy_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and all(x == x for x in losses)

    model = tmp_path / "consolidated"
    _ok(_tool("merge_checkpoints", "consolidate", str(toy_run), "--out", str(model)))
    assert torch.equal(load_file(str(model / "model.safetensors"))["interface.table.weight"],
                       state["interface.table.weight"])  # fmt: skip

    averaged = tmp_path / "averaged"
    _ok(_tool("merge_checkpoints", "average", str(toy_run), "--last", "2", "--out", str(averaged)))
    steps = [load_stage(toy_run / "checkpoints" / f"step-{s:08d}")[0] for s in (3, 4)]
    key = "encoder.layers.0.ffn.fc1.weight"
    mean = load_file(str(averaged / "model.safetensors"))[key]
    assert torch.allclose(mean, (steps[0][key] + steps[1][key]) / 2)
    # Its table trained: the averaged checkpoint's fingerprint is of the averaged table.
    table = load_file(str(averaged / "model.safetensors"))["interface.table.weight"]
    assert not torch.equal(steps[0]["interface.table.weight"], steps[1]["interface.table.weight"])
    recorded = read_model_dir_info(averaged).interface
    assert recorded == {"kind": NAME, "table": tensor_sha256(table)}

    connected = tmp_path / "connected"
    _ok(_tool("merge_checkpoints", "connect", "--encoder", str(toy_run), "--decoder",
              str(toy_run), "--out", str(connected)))  # fmt: skip
    weights = load_file(str(connected / "model.safetensors"))
    assert torch.equal(weights[key], state[key])
    assert not any(k.startswith("interface.") for k in weights)  # the decoder reads the encoder

    text = tmp_path / "en.txt"
    text.write_text("Open the file\nSave the document as\nThe file could not be read\n")
    diagnostics = tmp_path / "diagnostics.json"
    _ok(_tool("diagnose_interface", "--checkpoint", str(toy_run), "--text", f"en:{text}",
              "--output", str(diagnostics)))  # fmt: skip
    assert json.loads(diagnostics.read_text())["interface"] == NAME

    mlm = tmp_path / "valid-mlm.json"
    _ok(_tool("valid_mlm", "--checkpoint", str(toy_run), "--text", f"en:{text}",
              "--output", str(mlm)))  # fmt: skip
    assert json.loads(mlm.read_text())["mlm"] > 0

    hypotheses = tmp_path / "hyp.de"
    _ok(_tool("translate", "--model-dir", str(connected), "--src-lang", "en", "--tgt-lang", "de",
              "--input", str(text), "--output", str(hypotheses)))  # fmt: skip
    assert hypotheses.read_text(encoding="utf-8").count("\n") == 3  # a line per sentence

    exported = tmp_path / "hf"
    _ok(_tool("export", "huggingface", "--model-dir", str(connected), "--src-lang", "en",
              "--tgt-lang", "de", "--out", str(exported)))  # fmt: skip
    assert (exported / "config.json").is_file()
