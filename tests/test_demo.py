"""The README's main command (the whole pipeline) on the real demo corpus, at a reduced size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megasemface.demo import main
from megasemface.models.model_dir import load_seq2seq
from megasemface.tracking.compare import select_runs

pytestmark = pytest.mark.usefixtures("no_leftover_shared_memory")


def test_pipeline_runs_end_to_end_and_reuses_its_work(
    tmp_path: Path, locale_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "demo"
    args = ["--preset", "smoke", "--workdir", str(workdir), "--locale-dir", str(locale_dir)]
    args += ["--vocab-size", "1000"]
    assert main(args) == 0
    first = capsys.readouterr().out
    # The paper-shaped table: every system, both directions, the gain over no pre-training.
    assert "| system | en-de | de-en | avg | gain |" in first
    for system in ("Transformer", "CL-SemFace", "VQ-SemFace"):
        assert f"| {system} |" in first
    assert "mlflow ui --backend-store-uri sqlite:///" in first
    assert "copying the source unchanged scores BLEU en-de" in first
    for name in ("results.md", "test-bleu.png", "finetune-loss.png"):
        assert (workdir / name).stat().st_size > 0
    # Lineage in MLflow: SemFace fine-tuning runs descend from their pre-training run.
    runs = select_runs(f"sqlite:///{workdir / 'mlflow.db'}", tags={"stage": "finetune"})
    by_system = {r.tags["system_key"]: r for r in runs}
    assert set(by_system) == {"transformer", "cl", "vq"}
    assert "parent_encoder_run" in by_system["vq"].tags
    assert "parent_encoder_run" not in by_system["transformer"].tags
    assert all("test_bleu_en-de" in r.metrics and "test_chrf" in r.metrics for r in runs)
    # The connected models hold the pre-trained weights, the interface dropped.
    provenance = json.loads((workdir / "models" / "vq" / "provenance.json").read_text())
    assert provenance["mode"] == "semface"
    assert not any("interface" in key for key in provenance["parameters"])
    load_seq2seq(workdir / "runs" / "supervised-vq" / "best")

    assert main(args) == 0
    second = capsys.readouterr().out
    for reused in ("corpus", "spm", "cl", "runs/pretrain-vq", "models/cl", "runs/supervised-vq"):
        assert f"reusing {workdir / reused}" in second, reused
    assert "step 1/" not in second  # nothing was trained again


def test_pipeline_without_catalogs_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "locale"
    empty.mkdir()
    args = ["--preset", "smoke", "--workdir", str(tmp_path / "out"), "--locale-dir", str(empty)]
    assert main(args) == 2
    assert "--locale-dir" in capsys.readouterr().err
