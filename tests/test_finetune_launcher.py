"""Fine-tuning runs launched as the pipeline launches them, 2 CPU processes over gloo."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from launch import (
    ROOT,
    check_finished,
    ds_config,
    kill_after_checkpoint,
    launch,
    losses,
    mlflow_run,
    train_command,
)

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.models.model_dir import load_seq2seq

pytestmark = pytest.mark.launcher


def _finetune(data: dict, out: Path, shards: Path, *args: str, zero: int) -> list[str]:
    return train_command(
        {"shards": shards, "spm": data["spm"]},
        out,
        "--stage",
        "finetune",
        "--valid-prefix",
        str(data["valid"]),
        "--valid-max-sentences",
        "24",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "2",
        *args,
        config=ds_config(zero, out.parent),
    )


def _unsupervised(data: dict, out: Path, *args: str, zero: int) -> list[str]:
    """Unsupervised fine-tuning from the random model directory, short back-translations;
    validation at the last step unless ``args`` say otherwise."""
    steps = args[args.index("--steps") + 1]
    return _finetune(
        data,
        out,
        data["mono"],
        "--finetune-mode",
        "unsupervised",
        "--init-from",
        str(data["init"]),
        "--max-len-a",
        "1.0",
        "--max-len-b",
        "5",
        "--valid-interval",
        steps,
        *args,
        zero=zero,
    )


def test_supervised_finetune_zero2_validates_keeps_best_and_translates(
    launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "supervised"
    cmd = _finetune(
        launch_data,
        out,
        launch_data["parallel"],
        "--steps",
        "6",
        "--valid-interval",
        "3",
        "--save-interval",
        "3",
        "--tag",
        "system=Transformer",
        "--register-model",
        "megasemface-en-de-transformer",
        zero=2,
    )
    result = launch(cmd)
    check_finished(result, out, 6)
    assert "validation" in result.stdout and "valid_bleu" in result.stdout
    client, run = mlflow_run(out)
    # The best model, registered after the last step as a version of the run.
    (version,) = client.search_model_versions("name = 'megasemface-en-de-transformer'")
    assert version.run_id == run.info.run_id and version.tags["system"] == "Transformer"
    assert "registered" in result.stdout and version.source.startswith(f"runs:/{run.info.run_id}/")
    assert run.info.status == "FINISHED"
    assert run.data.tags["system"] == "Transformer" and run.data.tags["stage"] == "finetune"
    bleu = client.get_metric_history(run.info.run_id, "valid_bleu")
    assert [m.step for m in bleu] == [3, 6]
    assert {"valid_bleu_en-de", "valid_bleu_de-en", "valid_chrf", "mt_nll"} <= set(run.data.metrics)
    # The inverse square-root schedule: warm-up over 2 steps, then lr x sqrt(2 / step).
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "lr")}
    for step, value in lrs.items():
        assert value == pytest.approx(1e-3 * min(step / 2, math.sqrt(2 / step)), rel=1e-6)
    best = json.loads((out / "best" / "config.json").read_text())
    assert best["meta"]["valid_bleu"] == pytest.approx(run.data.metrics["best_valid_bleu"])
    assert best["meta"]["parent_runs"]["finetune"] == run.info.run_id
    assert float(version.tags["valid_bleu"]) == pytest.approx(best["meta"]["valid_bleu"], abs=1e-4)
    _, info = load_seq2seq(out / "best")
    assert info.languages == Tokenizer.load(launch_data["spm"]).languages
    # The best model directory is what the translate command reads (on the first lines of
    # the test split: the whole split would only take longer).
    for lang in ("en", "de"):
        lines = Path(f"{launch_data['test']}.{lang}").read_text(encoding="utf-8").splitlines()
        (tmp_path / f"test.{lang}").write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    translated = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "translate.py"),
            "--model-dir",
            str(out / "best"),
            "--src-lang",
            "en",
            "--tgt-lang",
            "de",
            "--input",
            str(tmp_path / "test.en"),
            "--reference",
            str(tmp_path / "test.de"),
            "--output",
            str(tmp_path / "hyp.de"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert translated.returncode == 0, translated.stderr[-2000:]
    assert "BLEU" in translated.stdout + translated.stderr
    hyps = (tmp_path / "hyp.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 40


def test_unsupervised_finetune_zero3_back_translates_in_lockstep(
    launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "unsupervised"
    cmd = _unsupervised(
        launch_data, out, "--denoise-schedule", "0:1,2:0.5,4:0", "--steps", "4", zero=3
    )
    result = launch(cmd, timeout=400)
    check_finished(result, out, 4)
    client, run = mlflow_run(out)
    assert run.data.tags["parent_encoder_run"] == "0123abcd"  # lineage from the model dir
    weights = {
        m.step: m.value for m in client.get_metric_history(run.info.run_id, "denoise_weight")
    }
    assert weights == {1: 0.75, 2: 0.5, 3: 0.25, 4: 0.0}
    assert client.get_metric_history(run.info.run_id, "bt")  # back-translation trained
    assert (out / "best" / "model.safetensors").is_file()


def test_killed_unsupervised_finetune_resumes_exactly(launch_data: dict, tmp_path: Path) -> None:
    """Back-translation, the denoising schedule, validation and the best model all carry over
    a kill: the resumed run logs the very losses and scores of an uninterrupted one."""

    def command(out: Path) -> list[str]:
        args = ["--denoise-schedule", "0:1,6:0", "--steps", "6", "--save-interval", "2"]
        return _unsupervised(launch_data, out, *args, "--valid-interval", "3", zero=2)

    reference = tmp_path / "reference"
    check_finished(launch(command(reference), timeout=400), reference, 6)
    out = tmp_path / "killed"
    kill_after_checkpoint(command(out), out, 4)  # after the validation of step 3
    assert not (out / "checkpoints" / "step-00000006").exists()
    result = launch(command(out), timeout=400)
    assert "resuming from" in result.stdout
    check_finished(result, out, 6)
    assert losses(out) == losses(reference)

    def scores(run_dir: Path) -> dict[str, dict[int, float]]:
        client, run = mlflow_run(run_dir)
        found: dict[str, dict[int, float]] = {}
        for key in ("valid_bleu", "valid_chrf", "best_valid_bleu", "denoise_weight", "bt"):
            history = client.get_metric_history(run.info.run_id, key)
            # A resumed run logs again the steps after its checkpoint: the newest value wins.
            for m in sorted(history, key=lambda m: m.timestamp):
                found.setdefault(key, {})[m.step] = m.value
        return found

    assert scores(out) == scores(reference)
    assert sorted(scores(out)["valid_bleu"]) == [3, 6]
    best, best_reference = (
        json.loads((r / "best" / "config.json").read_text()) for r in (out, reference)
    )
    assert best["meta"]["step"] == best_reference["meta"]["step"]
    assert best["meta"]["valid_bleu"] == best_reference["meta"]["valid_bleu"]


def test_finetune_refuses_wrong_data_and_model(launch_data: dict, tmp_path: Path) -> None:
    mono_supervised = launch(
        _finetune(launch_data, tmp_path / "a", launch_data["mono"], "--steps", "1", zero=2),
        timeout=120,
    )
    assert mono_supervised.returncode != 0
    assert "parallel shards" in mono_supervised.stderr + mono_supervised.stdout
    not_a_model = launch(
        _finetune(
            launch_data,
            tmp_path / "b",
            launch_data["parallel"],
            "--init-from",
            str(tmp_path),
            zero=2,
        ),
        timeout=120,
    )
    assert not_a_model.returncode != 0
    assert "not a megasemface model directory" in not_a_model.stderr + not_a_model.stdout
