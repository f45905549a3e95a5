"""Deep fusion end to end on real runs (2 CPU processes, gloo, the tiny preset in fp32):
connecting XLM, CL- and VQ-SemFace encoder stages through the coordinator, fine-tuning with
the four losses under ZeRO-1, 2 and 3, an exact resume, translating the best model and the
export's refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import (
    ROOT,
    check_finished,
    ds_config,
    launch,
    launch_chains,
    losses,
    mlflow_run,
    rewind,
)
from launch import train_command as _train_command

from megasemface.checkpoints import connect_fusion, load_stage, write_seq2seq_dir
from megasemface.cli.export import main as export_main
from megasemface.cli.merge_checkpoints import main as merge_main
from megasemface.models.model_dir import load_seq2seq

pytestmark = pytest.mark.launcher

ENCODERS = {"xlm": "none", "cl": "cl", "vq": "vq", "veco": "none"}
"""The encoder stages and their interfaces, and VECO's pre-training (its model's encoder)."""


def train_command(
    data: dict,
    shards: str,
    out: Path,
    *args: str,
    zero: int,
    tracking: bool = False,
    live: bool = True,
) -> list[str]:
    return _train_command(
        {"shards": data[shards], "spm": data["spm"]},
        out,
        *args,
        *(() if tracking else ("--no-tracking",)),
        "--lr",
        "1e-3",
        config=ds_config(zero, data["root"]),
        live=live,  # run by tests/launch.py, which chains runs in one launch
    )


@pytest.fixture(scope="module")
def encoders(
    launch_data: dict, mixed_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """One-step pre-trainings of the four kinds of encoder, in two launches side by side."""
    root = tmp_path_factory.mktemp("fusion-encoders")

    def command(name: str) -> list[str]:
        if name == "veco":
            data = {**launch_data, "mixed": mixed_shards}
            return train_command(
                data, "mixed", root / name, "--stage", "veco", "--steps", "1", zero=2
            )
        args = ("--stage", "encoder", "--interface", ENCODERS[name], "--steps", "1")
        cl = ("--cl-table", str(launch_data["cl"])) if name == "cl" else ()
        return train_command(launch_data, "mono", root / name, *args, *cl, zero=2)

    launch_chains([["xlm", "cl"], ["vq", "veco"]], command, lambda name: (root / name, 1))
    return {name: root / name for name in ENCODERS}


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_connect_fusion_from_each_kind_of_encoder(
    kind: str, encoders: dict[str, Path], tmp_path: Path
) -> None:
    connected = connect_fusion(encoders[kind])
    config = connected.config
    assert connected.mode == "fusion" and config.fusion == "deep"
    assert config.fusion_part_layers * config.decoder_layers == config.encoder_layers
    stage_state, meta = load_stage(encoders[kind])
    for key, value in connected.state.items():
        origin = connected.parameters[key]
        if key.startswith("encoder.") and kind == "veco":  # the whole model was trained
            assert origin == f"veco:model.{key}"
            assert torch.equal(value, stage_state[f"model.{key}"])
        elif key.startswith("encoder."):
            assert origin == f"encoder-stage:{key}"
            assert torch.equal(value, stage_state[key])
        else:
            assert origin == "random" and key.startswith(("decoder.", "coordinator."))
    assert any(k.startswith("coordinator.") for k in connected.state)
    model, info = load_seq2seq(write_seq2seq_dir(tmp_path / "fused", connected))
    assert info.model.fusion == "deep" and model.coordinator is not None
    assert info.meta["mode"] == "fusion" and info.interface == meta["interface"]
    provenance = json.loads((tmp_path / "fused" / "provenance.json").read_text())
    assert provenance["parameters"] == connected.parameters


def test_connect_fusion_command_line(
    encoders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m1"
    args = ["connect", "--encoder", str(encoders["xlm"]), "--fusion", "deep", "--out", str(out)]
    assert merge_main([*args, "--part-layers", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "fusion"
    _, info = load_seq2seq(out)
    assert (info.model.fusion_part_layers, info.model.decoder_layers) == (2, 1)
    bad = ["connect", "--encoder", str(encoders["xlm"]), "--fusion", "deep", "--out"]
    assert merge_main([*bad, str(tmp_path / "m2"), "--part-layers", "3"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "do not split into parts of 3 layers" in error[0]
    for wrong in (["--mbart", str(encoders["xlm"])], ["--decoder", str(encoders["xlm"])]):
        assert merge_main([*bad, str(tmp_path / "m3"), *wrong]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and "--fusion" in error[0]


def _finetune(
    data: dict, init: Path, out: Path, *args: str, zero: int, shards: str = "mixed", **launch: bool
) -> list[str]:
    """A fusion fine-tuning on the pairs and monolingual text of ``data[shards]``."""
    return train_command(
        data,
        shards,
        out,
        "--stage",
        "finetune",
        "--finetune-mode",
        "fusion",
        "--init-from",
        str(init),
        "--warmup-steps",
        "2",
        *args,
        zero=zero,
        **launch,
    )


LOGGED = ("mt", "twp", "tsp", "mlm", "tsp_accuracy", "mlm_accuracy")


def _logged(out: Path) -> dict[str, dict[int, float]]:
    """Each fusion loss's MLflow history (a resumed run logs its steps again: the newest
    value wins)."""
    client, run = mlflow_run(out)
    found: dict[str, dict[int, float]] = {}
    for key in LOGGED:
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            found.setdefault(key, {})[m.step] = m.value
    return found


def test_fusion_finetune_logs_each_loss_resumes_exactly_and_translates(
    launch_data: dict, mixed_shards: Path, encoders: dict[str, Path], tmp_path: Path
) -> None:
    """ZeRO-3 with validation, resumed exactly from its step-2 checkpoint (the monolingual
    loader's position included); ZeRO-1 with other weights; ZeRO-2 without MLM on parallel
    shards alone."""
    data = {**launch_data, "mixed": mixed_shards}
    init = write_seq2seq_dir(tmp_path / "init", connect_fusion(encoders["vq"]))
    valid = (
        "--valid-prefix", str(launch_data["valid"]), "--valid-max-sentences", "8",
        "--valid-interval", "4", "--max-len-b", "3",
    )  # fmt: skip
    runs = {
        "zero3": ("--steps", "4", "--save-interval", "2", *valid),
        "zero1": ("--steps", "2", "--fusion-weights", "1,0.5,0.5,0.5"),
        "zero2": ("--steps", "2", "--fusion-weights", "1,1,1,0"),
    }
    zeros = {"zero3": 3, "zero1": 1, "zero2": 2}
    shards = {"zero3": "mixed", "zero1": "mixed", "zero2": "parallel"}
    launch_chains(
        [["zero3"], ["zero1", "zero2"]],
        lambda name: _finetune(
            data,
            init,
            tmp_path / name,
            *runs[name],
            zero=zeros[name],
            shards=shards[name],
            tracking=True,
        ),
        lambda name: (tmp_path / name, int(runs[name][1])),
    )
    reference = tmp_path / "zero3"
    for name in runs:
        logged = _logged(tmp_path / name)
        left_out = {"mlm", "mlm_accuracy"} if name == "zero2" else set()  # weight 0
        assert set(logged) == set(LOGGED) - left_out
        assert all(sorted(history) == list(range(1, len(logged["mt"]) + 1))
                   for history in logged.values())  # fmt: skip
    # Exact resume from the checkpoint of step 2 under ZeRO-3.
    resumed = tmp_path / "resumed"
    rewind(reference, resumed, 2)
    command = _finetune(data, init, resumed, *runs["zero3"], zero=3, tracking=True)
    result = launch(command, timeout=400)
    check_finished(result, resumed, 4)
    assert "resuming from" in result.stdout
    assert losses(resumed) == losses(reference)
    assert _logged(resumed) == _logged(reference)
    # The best model is a plain translation model directory: translate reads it.
    best = reference / "best"
    _, info = load_seq2seq(best)
    assert info.model.fusion == "deep"
    lines = Path(f"{launch_data['valid']}.en").read_text(encoding="utf-8").splitlines()[:5]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    translated = subprocess.run(
        [
            sys.executable, str(ROOT / "tools" / "translate.py"), "--model-dir", str(best),
            "--src-lang", "en", "--tgt-lang", "de", "--input", str(tmp_path / "in.en"),
            "--output", str(tmp_path / "out.de"),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert translated.returncode == 0, translated.stderr[-2000:]
    assert len((tmp_path / "out.de").read_text(encoding="utf-8").splitlines()) == 5


def test_fusion_refusals_are_one_line(
    launch_data: dict,
    mixed_shards: Path,
    encoders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    fused = write_seq2seq_dir(tmp_path / "fused", connect_fusion(encoders["xlm"]))
    args = ["--src-lang", "en", "--tgt-lang", "de", "--model-dir", str(fused)]
    assert export_main(["ctranslate2", *args, "--out", str(tmp_path / "ct2")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "deep-fusion model" in error[0] and "translate.py" in error[0]
    # Fusion fine-tuning of a model without the coordinator
    plain = launch_data["init"]
    data = {**launch_data, "mixed": mixed_shards}
    result = launch(_finetune(data, plain, tmp_path / "p", "--steps", "1", zero=2, live=False))
    assert result.returncode != 0
    assert "--finetune-mode fusion fine-tunes a deep-fusion model" in result.stderr
    assert "Traceback" not in result.stderr
    # MLM without monolingual text in the shards
    result = launch(
        _finetune(
            launch_data, fused, tmp_path / "m", "--steps", "1", zero=2, shards="parallel",
            live=False,
        )
    )  # fmt: skip
    assert result.returncode != 0
    assert "holds no monolingual text of de, en for deep fusion's MLM loss" in result.stderr
    assert "--fusion-weights T,TWP,TSP,0" in result.stderr
    assert "Traceback" not in result.stderr
