"""Registering fine-tuned models in a real MLflow SQLite model registry, and naming them in
comparisons."""

from __future__ import annotations

import csv
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

import torch
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from megasemface.cli.compare_runs import main as compare_main
from megasemface.models.model_dir import save_model_dir
from megasemface.nn.config import build_model_config
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.pipeline.config import PipelineConfig
from megasemface.pipeline.pipeline import Pipeline
from megasemface.tracking.compare import CompareError, select_runs
from megasemface.tracking.model_registry import (
    RegistryError,
    default_model_name,
    register_best_model,
)
from megasemface.tracking.tracker import NullTracker, Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.units.validation import register_best

NAME = "megasemface-en-de-cl"
SIGNATURES = {"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.3", "chrf": "x"}


@dataclass(frozen=True)
class Store:
    uri: str
    experiment_id: str
    parent_id: str


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite store, made once: creating the schema takes seconds, a copy not."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(empty_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A store with one CL-SemFace pre-training run, the parent of fine-tuning runs."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(
        experiment_id, run_name="pretrain-cl", tags={"stage": "joint", "interface": "cl"}
    )
    client.set_terminated(parent.info.run_id)
    return Store(uri, experiment_id, parent.info.run_id)


def _finetuned(store: Store, root: Path, seed: int, valid_bleu: float) -> tuple[str, Path]:
    """A finished fine-tuning run tagged as the pipeline tags it, and its best model
    directory (a tiny random model) with test-scores.json beside it."""
    client = MlflowClient(store.uri)
    name = "supervised-cl" + (f"-s{seed}" if seed else "")
    tags = {
        "stage": "finetune",
        "interface": "none",
        "system": "CL-SemFace",
        "system_key": "cl",
        "setting": "supervised",
        "seed": str(seed),
        "parent_joint_run": store.parent_id,
    }
    run_id = client.create_run(store.experiment_id, run_name=name, tags=tags).info.run_id
    client.set_terminated(run_id)
    config = build_model_config("tiny", ["vocab_size=40", "max_len=16"])
    torch.manual_seed(seed)
    best = save_model_dir(
        root / name / "best",
        Seq2SeqModel(config).state_dict(),
        kind="seq2seq",
        model_config=config,
        languages=["en", "de"],
        spm_model=b"the SentencePiece model's bytes",
        provenance={"fine-tuned": str(root / name), "step": 6},
        meta={
            "stage": "finetune",
            "step": 6,
            "valid_bleu": valid_bleu,
            "valid_chrf": 30.25,
            "valid_bleu_en-de": valid_bleu,
            "parent_runs": {"joint": store.parent_id, "finetune": run_id},
        },
    )
    scores = {"test_bleu": 11.5, "test_chrf": 33.0, "test_bleu_en-de": 12.0}
    (best.parent / "test-scores.json").write_text(json.dumps({**scores, "signatures": SIGNATURES}))
    return run_id, best


def test_default_names() -> None:
    assert default_model_name(["en", "de"], "cl") == NAME
    assert default_model_name(["en", "de"], "vq") == "megasemface-en-de-vq"
    assert default_model_name(["en", "fr"], "vq", "unsupervised") == (
        "megasemface-en-fr-vq-unsupervised"
    )
    assert default_model_name(["en", "de"], "CL SemFace/x") == "megasemface-en-de-CL-SemFace-x"


def test_registered_version_points_back_to_its_run(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, best = _finetuned(store, tmp_path / "runs", 0, 12.5)
    version = register_best_model(store.uri, best)
    assert (version.name, version.version, version.created) == (NAME, "1", True)
    assert version.run_id == run_id
    assert version.source == f"runs:/{run_id}/model/step-6"
    assert version.uri == f"models:/{NAME}/1"

    client = MlflowClient(store.uri)
    (found,) = client.search_model_versions(f"run_id = '{run_id}'")
    assert (found.name, str(found.version), found.run_id, found.source) == (
        NAME,
        "1",
        run_id,
        version.source,
    )
    tags = found.tags
    assert tags["system"] == "CL-SemFace" and tags["system_key"] == "cl"
    assert tags["interface"] == "cl"  # the pre-training parent's, not the fine-tuning run's
    assert (tags["seed"], tags["setting"], tags["step"]) == ("0", "supervised", "6")
    assert tags["parent_joint_run"] == store.parent_id
    assert float(tags["valid_bleu"]) == 12.5 and float(tags["valid_chrf"]) == 30.25
    assert float(tags["test_bleu"]) == 11.5 and float(tags["test_bleu_en-de"]) == 12.0
    assert tags["test_bleu_signature"] == SIGNATURES["bleu"]
    assert tags["run_name"] == "supervised-cl" and tags["languages"] == "en,de"
    assert run_id in found.description and "12.5" in found.description
    assert client.get_model_version_by_alias(NAME, "best").version == 1

    # The version's files are the model directory's, byte for byte (models:/ URIs are
    # resolved in the registry MLFLOW_TRACKING_URI names).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    fetched = Path(download_artifacts(f"models:/{NAME}/1", dst_path=str(tmp_path / "dl")))
    names = sorted(p.name for p in best.iterdir())
    assert names == ["config.json", "model.safetensors", "provenance.json", "spm.model"]
    assert sorted(p.name for p in fetched.iterdir()) == names
    for name in names:
        assert (fetched / name).read_bytes() == (best / name).read_bytes()


def test_registering_again_reuses_the_version(store: Store, tmp_path: Path) -> None:
    run_id, best = _finetuned(store, tmp_path / "runs", 0, 12.5)
    first = register_best_model(store.uri, best, scores={})  # before the test scores
    assert "test_bleu" not in MlflowClient(store.uri).get_model_version(NAME, "1").tags
    again = register_best_model(store.uri, best)  # test-scores.json is there now
    assert (again.version, again.created, again.source) == ("1", False, first.source)
    client = MlflowClient(store.uri)
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 1
    assert float(client.get_model_version(NAME, "1").tags["test_bleu"]) == 11.5
    artifacts = [f.path for f in client.list_artifacts(run_id, "model")]
    assert artifacts == ["model/step-6"]  # logged once

    # Another seed's run is another version; "best" follows the higher validation BLEU.
    _, other = _finetuned(store, tmp_path / "runs", 1, 14.0)
    second = register_best_model(store.uri, other)
    assert (second.name, second.version, second.created) == (NAME, "2", True)
    assert client.get_model_version_by_alias(NAME, "best").version == 2
    named = register_best_model(store.uri, best, name="my-model")
    assert (named.name, named.version, named.created) == ("my-model", "1", True)


def test_only_a_tracked_finetuning_model_registers(store: Store, tmp_path: Path) -> None:
    _, best = _finetuned(store, tmp_path / "runs", 0, 12.5)
    config = json.loads((best / "config.json").read_text())
    del config["meta"]["parent_runs"]["finetune"]
    (best / "config.json").write_text(json.dumps(config))
    with pytest.raises(RegistryError, match="names no fine-tuning run"):
        register_best_model(store.uri, best)


def test_compare_selects_and_names_registered_versions(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first_id, first = _finetuned(store, tmp_path / "runs", 0, 12.5)
    second_id, second = _finetuned(store, tmp_path / "runs", 1, 14.0)
    _finetuned(store, tmp_path / "runs", 2, 9.0)  # never registered
    register_best_model(store.uri, first)
    register_best_model(store.uri, second)

    everything = select_runs(store.uri, tags={"stage": "finetune"})
    assert [r.registered for r in everything] == [(f"{NAME}/1",), (f"{NAME}/2",), ()]
    assert [r.run_id for r in select_runs(store.uri, registered=[f"{NAME}:1"])] == [first_id]
    assert [r.run_id for r in select_runs(store.uri, registered=[f"{NAME}@best"])] == [second_id]
    assert [r.run_id for r in select_runs(store.uri, registered=[NAME])] == [first_id, second_id]
    with pytest.raises(CompareError, match="no registered model version"):
        select_runs(store.uri, registered=[f"{NAME}:7"])

    status = compare_main(
        ["--tracking-uri", store.uri, "--registered", f"{NAME}:2", "--format", "csv"]
    )
    assert status == 0
    (row,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert (row["run"], row["registered"]) == ("supervised-cl-s1", f"{NAME}/2")
    assert compare_main(["--tracking-uri", store.uri, "--registered", "nothing-here"]) == 2
    assert "no registered model version 'nothing-here'" in capsys.readouterr().err


def test_the_pipeline_registers_each_system_with_its_test_scores_once(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipeline = Pipeline(PipelineConfig(workdir=tmp_path))  # its store: tmp_path/mlflow.db
    assert pipeline.tracking_uri == store.uri
    run_id, best = _finetuned(store, tmp_path / "runs", 0, 12.5)
    scores = json.loads((best.parent / "test-scores.json").read_text())
    vq = pipeline.config.system("vq")  # the system decides the tags, not the run's
    for _ in range(2):  # the pipeline run twice
        pipeline.register(vq, "unsupervised", best.parent, scores)
    printed = capsys.readouterr().out.splitlines()
    name = "megasemface-en-de-vq-unsupervised"
    assert printed == [f"   registered as models:/{name}/1", f"   reusing models:/{name}/1"]
    (version,) = MlflowClient(store.uri).search_model_versions(f"run_id = '{run_id}'")
    assert (version.tags["interface"], version.tags["system_key"]) == ("vq", "vq")
    assert version.tags["test_chrf_signature"] == SIGNATURES["chrf"]


class _RunTracker(Tracker):
    """The trainer's view of a tracked run that already exists in the store."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.tracking_uri = uri
        self._run_id = run_id

    @property
    def run_id(self) -> str | None:
        return self._run_id


def _finetune_config(out: Path, **values: object) -> TrainConfig:
    given: dict[str, object] = {"stage": "finetune", "valid_prefix": Path("valid"), **values}
    return TrainConfig(
        interface="none",
        data=Path("shards"),
        spm_model=Path("spm.model"),
        output_dir=out,
        **given,  # type: ignore[arg-type]
    )


def test_finetuning_registers_its_best_model_after_training(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id, best = _finetuned(store, tmp_path / "runs", 0, 12.5)
    config = _finetune_config(best.parent, register_model="ft-model")
    register_best(config, NullTracker())  # another rank, or no store: nothing
    register_best(_finetune_config(best.parent), _RunTracker(store.uri, run_id))  # not asked
    client = MlflowClient(store.uri)
    assert not client.search_registered_models()
    register_best(config, _RunTracker(store.uri, run_id))
    assert f"registered {best} as models:/ft-model/1" in capsys.readouterr().out
    (version,) = client.search_model_versions("name = 'ft-model'")
    assert version.run_id == run_id
    register_best(config, _RunTracker(store.uri, run_id))  # a finished run launched again
    assert "already registered" in capsys.readouterr().out
    assert len(client.search_model_versions("name = 'ft-model'")) == 1


def test_register_model_needs_finetuning_with_validation_and_tracking(tmp_path: Path) -> None:
    for values in ({"valid_prefix": None}, {"no_tracking": True}, {"stage": "encoder"}):
        with pytest.raises(ValueError, match="--register-model"):
            _finetune_config(tmp_path, register_model="m", **values)
