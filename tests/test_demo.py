"""The README's main command (the whole pipeline) on the real demo corpus, at a reduced size."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megasemface.demo import main
from megasemface.models.model_dir import load_seq2seq
from megasemface.tracking.compare import select_runs


@pytest.mark.launcher
def test_pipeline_runs_end_to_end_and_reuses_its_work(
    tmp_path: Path, locale_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "demo"
    args = ["--budget", "smoke", "--workdir", str(workdir), "--locale-dir", str(locale_dir)]
    # The catalogs alone, whatever documentation the machine has installed: the smoke run's
    # size stays the same everywhere (the documentation's part: tests/test_demo_corpus.py).
    args += ["--vocab-size", "1000", "--doc-root", str(tmp_path / "no-docs")]
    assert main(args) == 0
    first = capsys.readouterr().out
    # The paper-shaped table: every system, both directions, the gain over no pre-training.
    assert "| system | en-de | de-en | avg | gain |" in first
    for system in ("Transformer", "XLM", "mBART", "CL-SemFace", "VQ-SemFace"):
        assert f"| {system} |" in first
    assert "mlflow ui --backend-store-uri sqlite:///" in first
    assert "copying the source unchanged scores BLEU en-de" in first
    for name in ("results.md", "test-bleu.png", "finetune-loss.png"):
        assert (workdir / name).stat().st_size > 0
    # Lineage in MLflow: SemFace fine-tuning runs descend from their pre-training run.
    runs = select_runs(f"sqlite:///{workdir / 'mlflow.db'}", tags={"stage": "finetune"})
    by_system = {r.tags["system_key"]: r for r in runs}
    assert set(by_system) == {"transformer", "xlm", "mbart", "cl", "vq"}
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
    # Whether each connected, pre-trained model reads a translation, in both directions: the
    # SemFace systems and the references without an interface, in a file, MLflow and a table.
    assert "## does the connected, pre-trained model read a translation?" in results
    for key, display in (("xlm", "XLM"), ("mbart", "mBART"), ("cl", "CL-SemFace")):
        figures = json.loads(
            (workdir / "runs" / f"pretrain-{key}" / "diagnostics.json").read_text()
        )
        assert [d["direction"] for d in figures["reading"]] == ["en-de", "de-en"]
        (pretrain,) = select_runs(
            f"sqlite:///{workdir / 'mlflow.db'}", run_ids=[figures["mlflow_run_id"]]
        )
        nll = figures["reading"][0]["nll"]["translation"]
        assert pretrain.metrics["diag_read_en_de_nll_translation"] == pytest.approx(nll)
        assert f"| {display} | 0 | de-en |" in results
    # The encoder MLM on validation text of each pre-training that has one: a file, an MLflow
    # metric at the run's last step, a table with the gap to XLM.
    assert "## encoder MLM on validation text" in results
    for key in ("xlm", "cl", "vq"):
        figures = json.loads((workdir / "runs" / f"pretrain-{key}" / "valid-mlm.json").read_text())
        (pretrain,) = select_runs(
            f"sqlite:///{workdir / 'mlflow.db'}", run_ids=[figures["mlflow_run_id"]]
        )
        assert pretrain.metrics["final_valid_enc_mlm"] == pytest.approx(figures["mlm"])
    _assert_mlflow_shows_the_runs(workdir)
    # Where the time went: every step's wall time, summed per kind and in total.
    timings = json.loads((workdir / "timings.json").read_text())
    kinds = [step["kind"] for step in timings["steps"]]
    assert kinds.count("pre-training") == 4 and kinds.count("fine-tuning") == 5
    assert {"data", "diagnostics", "translation", "report"} <= set(kinds)
    assert sum(s["seconds"] for s in timings["steps"]) == pytest.approx(
        timings["total_seconds"], abs=0.1
    )
    assert sum(timings["by_kind"].values()) == pytest.approx(timings["total_seconds"], abs=0.1)
    assert f"each step: {workdir / 'timings.json'}" in first

    assert main(args) == 0
    second = capsys.readouterr().out
    reused_paths = ("corpus", "spm", "cl", "runs/pretrain-vq", "models/cl", "runs/supervised-vq")
    reused_paths += ("runs/pretrain-vq/diagnostics.json", "runs/pretrain-xlm/valid-mlm.json")
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
    # The comparison's run was updated, not added again.
    (report,) = select_runs(f"sqlite:///{workdir / 'mlflow.db'}", tags={"stage": "report"})
    assert "mean ± std over 2 seeds" in report.tags["mlflow.note.content"]

    # Another setting is not answered with the runs of the old one: the first run it changes
    # is named with what changed and what to do, and nothing is removed.
    assert main([*args, "--systems", "transformer", "--lr", "0.0007"]) == 2
    error = capsys.readouterr().err.strip()
    run_dir = workdir / "runs" / "supervised-transformer"
    assert error.startswith(f"error: {run_dir} was trained with other settings (lr: ")
    assert "0.0007" in error and "\n" not in error
    assert (run_dir / "test-scores.json").is_file()


def test_pipeline_without_catalogs_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "locale"
    empty.mkdir()
    args = ["--budget", "smoke", "--workdir", str(tmp_path / "out"), "--locale-dir", str(empty)]
    assert main(args) == 2
    assert "--locale-dir" in capsys.readouterr().err


def _assert_mlflow_shows_the_runs(workdir: Path) -> None:
    """What a user looks for in the MLflow UI, read back through its own API."""
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("megasemface-en-de")
    # A training experiment: MLflow 3's UI opens it on its runs, not its GenAI overview.
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # set_tracking_uri is process-global (and sets MLFLOW_TRACKING_URI): restored at once, so
    # later tests resolve their own stores.
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        frame = mlflow.search_runs(experiment_names=["megasemface-en-de"])
    finally:
        mlflow.set_tracking_uri(previous)
    by_name = {row["tags.mlflow.runName"]: row for _, row in frame.iterrows()}
    # The pre-training's interface is carried onto its fine-tuning runs.
    interfaces = {name: by_name[name]["tags.interface"] for name in by_name}
    assert interfaces["supervised-vq"] == "vq" and interfaces["supervised-cl"] == "cl"
    assert interfaces["supervised-transformer"] == "none"
    assert by_name["supervised-vq"]["tags.pretraining"] == "semface"
    # Lineage: the parent run is named and linked from the description.
    vq = client.get_run(by_name["supervised-vq"]["run_id"])
    parent_id = vq.data.tags["parent_encoder_run"]
    assert vq.data.tags["parent_encoder_run_name"] == "pretrain-vq"
    link = f"[pretrain-vq](#/experiments/{experiment.experiment_id}/runs/{parent_id})"
    assert link in vq.data.tags["mlflow.note.content"]
    # The shards a run read, as its dataset input, with their digest and counts.
    for name, shards in (("supervised-vq", "parallel-"), ("pretrain-vq", "mono")):
        run = client.get_run(by_name[name]["run_id"])
        (dataset_input,) = run.inputs.dataset_inputs
        dataset = dataset_input.dataset
        assert dataset.name.startswith(f"shards/{shards}"), dataset.name
        manifest = json.loads(
            (Path(json.loads(dataset.source)["uri"]) / "manifest.json").read_text()
        )
        assert dataset.digest == manifest["build_fingerprint"][:36]
        profile = json.loads(dataset.profile)
        assert profile["sentences"] == sum(s["sentences"] for s in manifest["shards"]) > 0
        assert [(t.key, t.value) for t in dataset_input.tags] == [
            ("mlflow.data.context", "training")
        ]
    # Artifacts: the test translations and scores with signatures, the best model, the
    # diagnostics of a pre-training.
    artifacts = {a.path for a in client.list_artifacts(vq.info.run_id, "test")}
    assert artifacts == {"test/test.en-de.de", "test/test.de-en.en", "test/test-scores.json"}
    local = client.download_artifacts(vq.info.run_id, "test/test-scores.json")
    scores = json.loads(Path(local).read_text())
    assert scores["signatures"]["bleu"].startswith("nrefs:1|")
    assert scores["test_bleu"] == vq.data.metrics["test_bleu"]
    (model,) = client.list_artifacts(vq.info.run_id, "model")
    assert {
        a.path.rsplit("/", 1)[1] for a in client.list_artifacts(vq.info.run_id, model.path)
    } >= {
        "model.safetensors",
        "config.json",
        "spm.model",
    }
    assert "diagnostics.json" in {a.path for a in client.list_artifacts(parent_id)}
    # The comparison itself: a run of its own whose description is the report.
    (report,) = client.search_runs([experiment.experiment_id], "tags.stage = 'report'")
    assert report.data.tags["mlflow.note.content"].startswith("# megasemface comparison, en-de")
    files = {a.path for a in client.list_artifacts(report.info.run_id)}
    assert files == {"results.md", "test-bleu.png", "finetune-loss.png"}
