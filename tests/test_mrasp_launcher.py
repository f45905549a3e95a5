"""mRASP's pre-training and random aligned substitution in launched runs, 2 CPU processes
over gloo, under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launch import (
    check_finished,
    ds_config,
    launch,
    losses,
    mlflow_run,
    rewind,
    train_command,
)

from megasemface.checkpoints import connect_mbart, write_seq2seq_dir
from megasemface.checkpoints.consolidate import load_stage

pytestmark = pytest.mark.launcher


def _mrasp(data: dict, out: Path, dictionary: Path, *args: str, zero: int) -> list[str]:
    return train_command(
        {"shards": data["parallel"], "spm": data["spm"]},
        out,
        "--stage",
        "mrasp",
        "--ras-dictionary",
        str(dictionary),
        "--lr",
        "1e-3",
        *args,
        config=ds_config(zero, out.parent),
    )


def _ras_figures(client: Any, run: Any) -> list[tuple[float, float]]:
    """(dictionary words, replaced) shares of the logged steps."""
    words = client.get_metric_history(run.info.run_id, "ras_dictionary_words")
    replaced = client.get_metric_history(run.info.run_id, "ras_replaced")
    return [(a.value, b.value) for a, b in zip(words, replaced, strict=True)]


def test_mrasp_zero2_resumes_exactly_and_connects(
    launch_data: dict, demo_corpus: Path, tmp_path: Path
) -> None:
    """Substitution draws from the step's seeded generator, so a run resumed from its
    checkpoint of step 2 computes the uninterrupted run's losses exactly; the run connects
    as a seq2seq model that names it as its parent."""
    dictionary = demo_corpus / "dict" / "en-de.tsv"
    args = ("--steps", "4", "--save-interval", "2", "--tag", "system=mRASP")
    reference = tmp_path / "reference"
    result = launch(_mrasp(launch_data, reference, dictionary, *args, zero=2))
    check_finished(result, reference, 4)
    assert sorted(losses(reference)) == [1, 2, 3, 4]
    client, run = mlflow_run(reference)
    assert run.data.tags["stage"] == "mrasp" and run.data.tags["system"] == "mRASP"
    assert run.data.tags["interface"] == "none" and "parent_mrasp_run" not in run.data.tags
    figures = _ras_figures(client, run)
    assert len(figures) == 4 and all(0 < replaced < words < 1 for words, replaced in figures)

    out = tmp_path / "resumed"
    rewind(reference, out, 2)  # as the run stood at its checkpoint of step 2
    resumed = launch(_mrasp(launch_data, out, dictionary, *args, zero=2))
    assert "resuming from" in resumed.stdout
    check_finished(resumed, out, 4)
    assert losses(out) == losses(reference)  # identical, not just close

    connected = connect_mbart(reference)
    assert connected.mode == "mrasp" and set(connected.sources) == {"mrasp"}
    trained, meta = load_stage(reference)
    assert meta["stage"] == "mrasp" and meta["interface"]["kind"] == "mrasp"
    assert set(connected.parameters.values()) == {f"mrasp:{key}" for key in trained}
    model_dir = write_seq2seq_dir(tmp_path / "model", connected, spm_model=launch_data["spm"])
    from megasemface.models.model_dir import load_seq2seq

    _, info = load_seq2seq(model_dir)
    assert info.meta["mode"] == "mrasp"
    assert info.meta["parent_runs"] == {"mrasp": run.info.run_id}


def test_mrasp_zero3_then_finetuning_with_ras_keeps_its_lineage(
    launch_data: dict, demo_corpus: Path, tmp_path: Path
) -> None:
    """ZeRO-3 pre-training, connected, then supervised fine-tuning with --finetune-ras: the
    fine-tuning run names the mRASP run as its parent in MLflow."""
    dictionary = demo_corpus / "dict" / "en-de.tsv"
    pretrain = tmp_path / "mrasp"
    result = launch(_mrasp(launch_data, pretrain, dictionary, "--steps", "3", zero=3))
    check_finished(result, pretrain, 3)
    _, mrasp_run = mlflow_run(pretrain)
    model_dir = write_seq2seq_dir(
        tmp_path / "model", connect_mbart(pretrain), spm_model=launch_data["spm"]
    )

    out = tmp_path / "finetune"
    cmd = train_command(
        {"shards": launch_data["parallel"], "spm": launch_data["spm"]},
        out,
        "--stage",
        "finetune",
        "--init-from",
        str(model_dir),
        "--finetune-ras",
        "--ras-dictionary",
        str(dictionary),
        "--ras-prob",
        "0.5",
        "--valid-prefix",
        str(launch_data["valid"]),
        "--valid-max-sentences",
        "8",
        "--steps",
        "2",
        config=ds_config(2, out.parent),
    )
    result = launch(cmd)
    check_finished(result, out, 2)
    client, run = mlflow_run(out)
    assert run.data.tags["pretraining"] == "mrasp"
    assert run.data.tags["parent_mrasp_run"] == mrasp_run.info.run_id
    assert len(_ras_figures(client, run)) == 2


def test_decoder_noise_ras_in_the_joint_stage_zero3(
    launch_data: dict, demo_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "joint"
    cmd = train_command(
        {"shards": launch_data["mono"], "spm": launch_data["spm"]},
        out,
        "--stage",
        "joint",
        "--interface",
        "vq",
        "--decoder-noise-ras",
        "--ras-dictionary",
        str(demo_corpus / "dict" / "en-de.tsv"),
        "--steps",
        "3",
        config=ds_config(3, out.parent),
    )
    check_finished(launch(cmd), out, 3)
    client, run = mlflow_run(out)
    figures = _ras_figures(client, run)
    assert len(figures) == 3 and all(0 < replaced < words for words, replaced in figures)
