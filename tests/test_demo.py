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
    args = ["--budget", "smoke", "--workdir", str(workdir), "--locale-dir", str(locale_dir)]
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
    # Interface diagnostics of each SemFace pre-training: a file, MLflow metrics, a table.
    assert "## interface diagnostics" in (workdir / "results.md").read_text()
    for key in ("cl", "vq"):
        path = workdir / "runs" / f"pretrain-{key}" / "diagnostics.json"
        figures = json.loads(path.read_text())
        (pretrain,) = select_runs(
            f"sqlite:///{workdir / 'mlflow.db'}", run_ids=[figures["mlflow_run_id"]]
        )
        assert "diag_en_cosine" in pretrain.metrics, sorted(pretrain.metrics)
    results = (workdir / "results.md").read_text()
    assert "| VQ-SemFace | 0 | en |" in results and "| CL-SemFace | 0 | de |" in results

    assert main(args) == 0
    second = capsys.readouterr().out
    reused_paths = ("corpus", "spm", "cl", "runs/pretrain-vq", "models/cl", "runs/supervised-vq")
    reused_paths += ("runs/pretrain-vq/diagnostics.json",)
    for reused in reused_paths:
        assert f"reusing {workdir / reused}" in second, reused
    assert "step 1/" not in second  # nothing was trained again

    # A second seed of two systems: seed 0's runs are reused, seed 1's are trained beside them,
    # and the table reads both (mean ± std, sacreBLEU's paired bootstrap p-values).
    assert main([*args, "--systems", "transformer,vq", "--seeds", "0,1"]) == 0
    third = capsys.readouterr().out
    for reused in ("runs/pretrain-vq", "models/vq", "runs/supervised-transformer"):
        assert f"reusing {workdir / reused}" in third, reused
    for trained in ("runs/pretrain-vq-s1", "models/vq-s1", "runs/supervised-vq-s1"):
        assert (workdir / trained).is_dir(), trained
    assert "mean ± std over 2 seeds: 0, 1" in third
    header = "| system | en-de | de-en | avg | gain | p en-de | p de-en |"
    assert header in third
    rows = [line for line in third.splitlines() if line.startswith("| VQ-SemFace |")]
    cells = [c.strip() for c in rows[0].strip("| ").split(" | ")]
    assert "±" in cells[1] and cells[4] != "-"
    assert all(0 < float(p.rstrip("*")) <= 1 for p in cells[5:7])
    runs = select_runs(f"sqlite:///{workdir / 'mlflow.db'}", tags={"stage": "finetune"})
    seeds = {(r.tags["system_key"], r.tags.get("seed")): r for r in runs}
    assert set(seeds) >= {("transformer", "0"), ("transformer", "1"), ("vq", "0"), ("vq", "1")}
    assert seeds[("vq", "1")].name == "supervised-vq-s1"
    parent = seeds[("vq", "1")].tags["parent_encoder_run"]
    (pretrain,) = select_runs(f"sqlite:///{workdir / 'mlflow.db'}", run_ids=[parent])
    assert (pretrain.name, pretrain.tags["seed"]) == ("pretrain-vq-s1", "1")


def test_pipeline_without_catalogs_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "locale"
    empty.mkdir()
    args = ["--budget", "smoke", "--workdir", str(tmp_path / "out"), "--locale-dir", str(empty)]
    assert main(args) == 2
    assert "--locale-dir" in capsys.readouterr().err
