"""The pipeline reuses a run only for the settings it was trained with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megasemface.models.model_dir import FORMAT
from megasemface.pipeline.config import PipelineConfig
from megasemface.pipeline.connecting import connect_system
from megasemface.pipeline.data_steps import table_matches
from megasemface.pipeline.launcher import LaunchError, changed_settings, lineage
from megasemface.pipeline.pipeline import Pipeline
from megasemface.pipeline.run_inputs import INPUTS_FILE, changed_inputs, record_inputs
from megasemface.pipeline.systems import SYSTEMS
from megasemface.training.options import TrainConfig


def _config(workdir: Path, **values: object) -> TrainConfig:
    return TrainConfig(
        stage="finetune",
        interface="none",
        data=workdir / "shards" / "parallel",
        spm_model=workdir / "spm" / "joint.model",
        output_dir=workdir / "runs" / "supervised-transformer",
        init_from=workdir / "models" / "transformer",
        lr=2e-3,
        tags=["seed=0"],
        **values,  # type: ignore[arg-type]
    )


def _record(config: TrainConfig, drop: tuple[str, ...] = ()) -> Path:
    """A run directory whose config.json holds ``config``, as train.py writes it."""
    run_dir = config.output_dir
    run_dir.mkdir(parents=True)
    train = {k: v for k, v in config.to_dict().items() if k not in drop}
    (run_dir / "config.json").write_text(json.dumps({"train": train, "model": {}}))
    return run_dir


def test_a_run_not_started_or_started_alike_is_reused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert changed_settings(config.output_dir, config) == []
    _record(config)
    assert changed_settings(config.output_dir, config) == []


def test_each_changed_setting_is_named_with_both_values(tmp_path: Path) -> None:
    run_dir = _record(_config(tmp_path))
    wanted = _config(tmp_path, no_repeat_ngram_size=3, model_options=["d_model=128"])
    assert changed_settings(run_dir, wanted) == [
        "model_options: [] -> ['d_model=128']",
        "no_repeat_ngram_size: 0 -> 3",
    ]
    other_init = _config(tmp_path)
    other_init.init_from = tmp_path / "models" / "vq"
    assert changed_settings(run_dir, other_init) == [
        f"init_from: '{tmp_path}/models/transformer' -> '{tmp_path}/models/vq'"
    ]


def test_what_does_not_change_the_results_is_not_compared(tmp_path: Path) -> None:
    run_dir = _record(_config(tmp_path))
    wanted = _config(tmp_path, steps=2000, compile=True, log_interval=1, keep_last=1, run_name="x")
    wanted.tags = ["seed=0", "note=again"]
    assert changed_settings(run_dir, wanted) == []


def test_a_record_of_an_earlier_version_counts_missing_settings_as_their_defaults(
    tmp_path: Path,
) -> None:
    run_dir = _record(_config(tmp_path), drop=("no_repeat_ngram_size", "decoder_codes"))
    assert changed_settings(run_dir, _config(tmp_path)) == []
    assert changed_settings(run_dir, _config(tmp_path, no_repeat_ngram_size=3)) == [
        "no_repeat_ngram_size: 0 -> 3"
    ]
    # A joint VQ run of that version read the extractor's codes, no longer the default.
    joint = TrainConfig(
        stage="joint",
        interface="vq",
        data=tmp_path / "shards" / "mono",
        spm_model=tmp_path / "spm" / "joint.model",
        output_dir=tmp_path / "runs" / "pretrain-vq",
    )
    # and its codes alone, before --decoder-continuous existed.
    run_dir = _record(joint, drop=("decoder_codes", "decoder_continuous"))
    assert changed_settings(run_dir, joint) == [
        "decoder_codes: 'extractor' -> 'encoder-trained'",
        "decoder_continuous: 0.0 -> 0.5",
    ]
    paper = TrainConfig(**{**vars(joint), "decoder_codes": "extractor", "decoder_continuous": None})
    assert changed_settings(run_dir, paper) == []


def test_a_moved_work_directory_is_still_reused(tmp_path: Path) -> None:
    _record(_config(tmp_path / "old"))
    (tmp_path / "old").rename(tmp_path / "new")
    moved = _config(tmp_path / "new")
    assert changed_settings(moved.output_dir, moved) == []


@pytest.mark.parametrize("text", ["{not json", '{"model": {}}', "[]", ""])
def test_an_unreadable_record_is_one_line_naming_it(tmp_path: Path, text: str) -> None:
    config = _config(tmp_path)
    config.output_dir.mkdir(parents=True)
    (config.output_dir / "config.json").write_text(text)
    with pytest.raises(LaunchError) as caught:
        changed_settings(config.output_dir, config)
    message = str(caught.value)
    assert str(config.output_dir / "config.json") in message and "\n" not in message
    assert f"remove {config.output_dir}" in message


def _model_dir(path: Path, parents: dict[str, str]) -> Path:
    """A connected model directory as the pipeline writes it (the weights file stands for
    itself: only the record is read)."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    meta = {"format": FORMAT, "kind": "seq2seq", "meta": {"parent_runs": parents}}
    (path / "config.json").write_text(json.dumps(meta))
    return path


def _finished(config: TrainConfig, run_id: str, parents: dict[str, str]) -> Path:
    """A run directory with a complete final checkpoint recording its lineage."""
    run_dir = _record(config)
    tag = run_dir / "checkpoints" / f"step-{config.steps:08d}"
    tag.mkdir(parents=True)
    (tag / "meta.json").write_text(json.dumps({"mlflow_run_id": run_id, "parent_runs": parents}))
    (tag / "COMPLETE").write_text("")
    return run_dir


def _pipeline(workdir: Path) -> Pipeline:
    return Pipeline(PipelineConfig(workdir=workdir))


def test_lineage_reads_runs_and_model_directories(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert lineage(config.output_dir) == (None, {})  # not started
    _finished(config, "run-b", {"encoder": "run-a"})
    assert lineage(config.output_dir) == ("run-b", {"encoder": "run-a"})
    model = _model_dir(tmp_path / "models" / "vq", {"encoder": "run-a", "decoder": "run-a"})
    assert lineage(model) == (None, {"encoder": "run-a", "decoder": "run-a"})


def test_a_fine_tuning_of_another_pre_training_is_not_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    _finished(config, "ft", {"encoder": "old", "decoder": "old"})
    _model_dir(config.init_from, {"encoder": "old", "decoder": "old"})  # type: ignore[arg-type]
    _pipeline(tmp_path)._train(config)
    assert f"reusing {config.output_dir}" in capsys.readouterr().out

    new = tmp_path / "models" / "new"
    _model_dir(new, {"encoder": "new", "decoder": "new"})
    (tmp_path / "models" / "transformer" / "config.json").write_bytes(
        (new / "config.json").read_bytes()
    )
    with pytest.raises(LaunchError, match="was started from another pre-training") as caught:
        _pipeline(tmp_path)._train(config)
    assert "\n" not in str(caught.value) and f"{config.output_dir}" in str(caught.value)


def test_a_connection_of_another_pre_training_is_not_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    system = SYSTEMS["vq"]
    pretrain = _config(tmp_path)
    pretrain.output_dir = tmp_path / "runs" / "pretrain-vq"
    _finished(pretrain, "pre", {})
    connected = _model_dir(tmp_path / "models" / "vq", {"encoder": "pre", "decoder": "pre"})
    spm = tmp_path / "spm.model"  # not read: the connection is reused or refused
    assert connect_system(system, pretrain.output_dir, connected, spm, 0) == connected
    assert f"reusing {connected}" in capsys.readouterr().out

    meta = pretrain.output_dir / "checkpoints" / f"step-{pretrain.steps:08d}" / "meta.json"
    meta.write_text(json.dumps({"mlflow_run_id": "retrained", "parent_runs": {}}))
    with pytest.raises(LaunchError, match="was connected from another run") as caught:
        connect_system(system, pretrain.output_dir, connected, spm, 0)
    assert "retrained" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("text", ["{not json", "[]"])
def test_an_unreadable_checkpoint_record_is_one_line_naming_it(tmp_path: Path, text: str) -> None:
    config = _config(tmp_path)
    run_dir = _finished(config, "run", {})
    meta = run_dir / "checkpoints" / f"step-{config.steps:08d}" / "meta.json"
    meta.write_text(text)
    with pytest.raises(LaunchError) as caught:
        lineage(run_dir)
    assert str(meta) in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_trained_past_the_steps_asked_is_refused_in_one_line(tmp_path: Path) -> None:
    # A work directory of a longer budget: train.py would resume past the end and never
    # write the shorter run's final checkpoint.
    _finished(_config(tmp_path, steps=6), "pre", {})
    shorter = _config(tmp_path, steps=3)
    with pytest.raises(LaunchError, match="is trained to step 6, past the 3 asked") as caught:
        _pipeline(tmp_path)._train(shorter)
    assert "\n" not in str(caught.value) and f"{shorter.output_dir}" in str(caught.value)


def test_a_finished_pre_training_s_encoder_mlm_is_measured_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The encoder MLM of a finished pre-training, on the pipeline's validation text: written
    to ``<run>/valid-mlm.json`` and logged to the run's MLflow run the first time, read back
    from the file after (a work directory whose runs lack it gets it on the next run)."""
    from megasemface.evaluation import encoder_mlm as mlm

    run_dir = tmp_path / "runs" / "pretrain-xlm"
    run_dir.mkdir(parents=True)
    result = mlm.EncoderMlm(
        mlm=6.5,
        languages=[mlm.LanguageMlm("en", 2, 10, 6.0), mlm.LanguageMlm("de", 2, 10, 7.0)],
        step=1000,
        stage="encoder",
        interface="none",
        max_sentences=200,
        checkpoint=str(run_dir),
        mlflow_run_id="0123abcd",
    )
    calls: list[tuple[object, ...]] = []

    def measure(
        checkpoint: Path, texts: dict[str, Path], *, spm_model: Path, max_sentences: int
    ) -> mlm.EncoderMlm:
        calls.append(("measure", checkpoint, dict(texts), spm_model, max_sentences))
        return result

    def log(measured: mlm.EncoderMlm, *, tracking_uri: str, run_id: str) -> int:
        calls.append(("log", tracking_uri, run_id))
        return 3

    monkeypatch.setattr(mlm, "encoder_mlm", measure)
    monkeypatch.setattr(mlm, "log_to_run", log)
    config = PipelineConfig(workdir=tmp_path, systems=("xlm",), valid_sentences=150)
    pipeline = Pipeline(config)
    pipeline.spm = tmp_path / "spm" / "joint.model"
    pipeline.valid = tmp_path / "corpus" / "valid"
    first = pipeline.encoder_mlm(run_dir)
    texts = {lang: Path(f"{pipeline.valid}.{lang}") for lang in ("en", "de")}
    assert calls == [
        ("measure", run_dir, texts, pipeline.spm, 150),
        ("log", pipeline.tracking_uri, "0123abcd"),
    ]
    assert first == result.to_dict() == json.loads((run_dir / "valid-mlm.json").read_text())
    calls.clear()
    assert pipeline.encoder_mlm(run_dir) == first
    assert calls == []
    assert f"reusing {run_dir / 'valid-mlm.json'}" in capsys.readouterr().out


def _joint_cl(workdir: Path) -> TrainConfig:
    """A CL-SemFace joint run of the pipeline, whose table and RAS dictionary exist."""
    for path, text in (
        (workdir / "spm" / "joint.model", "model"),
        (workdir / "shards" / "mono" / "manifest.json", "{}"),
        (workdir / "cl" / "table.safetensors", "table"),
        (workdir / "ras" / "en-de.tsv", "haus\thouse\n"),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return TrainConfig(
        stage="joint",
        interface="cl",
        data=workdir / "shards" / "mono",
        spm_model=workdir / "spm" / "joint.model",
        output_dir=workdir / "runs" / "pretrain-cl-ras",
        cl_table=workdir / "cl" / "table.safetensors",
        ras_dictionary=[workdir / "ras" / "en-de.tsv"],
        decoder_noise_ras=True,
        tags=["seed=0"],
    )


@pytest.mark.parametrize(
    ("rebuilt", "option"),
    [
        ("cl/table.safetensors", "cl_table"),
        ("ras/en-de.tsv", "ras_dictionary[0]"),
        ("shards/mono/manifest.json", "data"),
        ("spm/joint.model", "spm_model"),
    ],
)
def test_a_run_on_an_input_rebuilt_at_the_same_path_is_not_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rebuilt: str, option: str
) -> None:
    """The same settings, the same paths: a table built with other epochs or a dictionary
    induced with other thresholds in place of the one the run read is named, in one line."""
    config = _joint_cl(tmp_path)
    assert changed_inputs(config.output_dir, config) == []  # no record: nothing to compare
    _finished(config, "pre", {})
    record_inputs(config.output_dir, config)
    assert changed_inputs(config.output_dir, config) == []
    _pipeline(tmp_path)._train(config)
    assert f"reusing {config.output_dir}" in capsys.readouterr().out

    (tmp_path / rebuilt).write_text("built again")
    assert changed_inputs(config.output_dir, config) == [f"{option} ({tmp_path / rebuilt})"]
    with pytest.raises(LaunchError, match="was trained on other contents of") as caught:
        _pipeline(tmp_path)._train(config)
    message = str(caught.value)
    assert "\n" not in message and option in message and "remove that directory" in message


def test_the_inputs_record_is_keyed_by_option_so_a_moved_work_directory_is_reused(
    tmp_path: Path,
) -> None:
    config = _joint_cl(tmp_path / "old")
    _finished(config, "pre", {})
    record_inputs(config.output_dir, config)
    (tmp_path / "old").rename(tmp_path / "new")
    moved = _joint_cl(tmp_path / "new")  # the same contents, written again at the new place
    assert changed_inputs(moved.output_dir, moved) == []
    moved.ras_dictionary = []  # a run that no longer reads the dictionary it was trained on
    assert changed_inputs(moved.output_dir, moved) == ["ras_dictionary[0] (no longer read)"]


@pytest.mark.parametrize("text", ["{not json", "[]"])
def test_an_unreadable_inputs_record_counts_every_input_as_changed(
    tmp_path: Path, text: str
) -> None:
    config = _joint_cl(tmp_path)
    config.output_dir.mkdir(parents=True)
    (config.output_dir / INPUTS_FILE).write_text(text)
    assert len(changed_inputs(config.output_dir, config)) == 4


def test_a_table_is_reused_only_as_the_run_asks_for_it(tmp_path: Path) -> None:
    """The CL table's build report against the run: its width, epochs, seeds and centring;
    a table of a version before the centring counts as uncentred and is built again."""
    config = PipelineConfig(workdir=tmp_path)
    seeds = [["train.en", "train.de"]]
    built = {
        "dim": 64,
        "config": {"skipgram": {"epochs": config.cl_epochs}, "centre_languages": True},
        "seeds": [{"files": seeds}],
    }
    assert table_matches(built, config, 64, seeds)
    assert not table_matches(built, config, 128, seeds)
    assert not table_matches(built, config, 64, [])
    assert not table_matches(built, dataclasses.replace(config, cl_epochs=3), 64, seeds)
    del built["config"]["centre_languages"]
    assert not table_matches(built, config, 64, seeds)
