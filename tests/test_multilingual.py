"""The pipeline over several languages (``--languages``), end to end at the smoke budget:
one pre-training over all of them, every pair fine-tuned from it, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from megasemface.cli.reproduce import main
from megasemface.tracking.compare import select_runs

LANGUAGES = ("en", "de", "fr")
"""English and the two catalogs with the most text (docs/data.md)."""


def test_one_pretraining_over_every_language_is_fine_tuned_on_every_pair(
    tmp_path: Path, locale_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "multi"
    args = ["--budget", "smoke", "--workdir", str(workdir), "--locale-dir", str(locale_dir)]
    args += ["--languages", ",".join(LANGUAGES), "--systems", "vq", "--settings", "supervised"]
    # One process and few sentences: the claim is the lineage and the table, not the scores.
    args += ["--vocab-size", "1000", "--procs", "1", "--test-sentences", "10"]
    args += ["--valid-sentences", "5", "--doc-root", str(tmp_path / "no-docs")]  # catalogs alone
    assert main(args) == 0
    out = capsys.readouterr().out
    # One table: every pair's two directions and the average.
    assert "| system | en-de | de-en | en-fr | fr-en | avg | gain |" in out
    results = (workdir / "results.md").read_text()
    table = results[: results.index("## interface diagnostics")]
    (row,) = [line for line in table.splitlines() if line.startswith("| VQ-SemFace |")]
    cells = [c.strip() for c in row.strip("| ").split(" | ")]
    assert all(float(c) >= 0 for c in cells[1:6]), row
    # One shard directory over every language; each pair's parallel shards.
    shards = {p.name for p in (workdir / "shards").iterdir()}
    assert shards == {"mono", "parallel-en-de-2000", "parallel-en-fr-2000"}
    manifest = json.loads((workdir / "shards" / "mono" / "manifest.json").read_text())
    assert sorted(manifest["languages"]) == sorted(LANGUAGES)
    # One pre-training, the parent of both pairs' fine-tuning runs.
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    (pretrain,) = select_runs(uri, tags={"stage": "joint"})
    assert pretrain.name == "pretrain-vq"
    runs = select_runs(uri, tags={"stage": "finetune"})
    assert sorted((r.name, r.tags["pair"]) for r in runs) == [
        ("supervised-vq-en-de", "en-de"),
        ("supervised-vq-en-fr", "en-fr"),
    ]
    for run in runs:
        assert run.tags["parent_encoder_run"] == pretrain.run_id, run.name
        assert "test_bleu_" + run.tags["pair"] in run.metrics
    # The pre-training's record: the loader's temperature and each language's count and share.
    assert float(pretrain.params["loader.temperature"]) == pytest.approx(1 / 0.7)
    shares = {lang: float(pretrain.params[f"loader.probability.{lang}"]) for lang in LANGUAGES}
    assert sum(shares.values()) == pytest.approx(1, abs=1e-5)
    sentences = {
        lang: sum(s["sentences"] for s in manifest["shards"] if s["lang"] == lang)
        for lang in LANGUAGES
    }
    # Temperature sampling: the smallest language gets more than its raw share.
    smallest = min(sentences, key=sentences.__getitem__)
    assert shares[smallest] > sentences[smallest] / sum(sentences.values())
    local = MlflowClient(uri).download_artifacts(pretrain.run_id, "sampling.json")
    sampling = json.loads(Path(local).read_text())
    assert {lang: v["sentences"] for lang, v in sampling["languages"].items()} == sentences
