"""VECO's pre-training in launched runs, 2 CPU processes over gloo,
under ZeRO-2 and ZeRO-3, on one shard directory of monolingual text and en-de pairs; each
run connects into a translation model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import check_finished, ds_config, launch, losses, mlflow_run, train_command

from megasemface.checkpoints import connect_mbart, write_seq2seq_dir
from megasemface.checkpoints.consolidate import load_stage
from megasemface.models.model_dir import load_seq2seq_state

pytestmark = pytest.mark.launcher


def _veco(shards: Path, spm: Path, out: Path, *args: str, zero: int) -> list[str]:
    return train_command(
        {"shards": shards, "spm": spm},
        out,
        "--stage",
        "veco",
        "--lr",
        "1e-3",
        "--tag",
        "system=VECO",
        *args,
        config=ds_config(zero, out.parent),
    )


def _connected_model(run_dir: Path, spm: Path, out: Path, run_id: str) -> tuple[dict, Any]:
    """Connects the run, checks what it keeps and its lineage; returns the model directory's
    weights and info."""
    connected = connect_mbart(run_dir)
    assert connected.mode == "veco" and set(connected.sources) == {"veco"}
    trained, meta = load_stage(run_dir)
    assert meta["stage"] == "veco" and meta["interface"]["kind"] == "veco"
    # Everything of the sequence-to-sequence model is pre-trained; IS-MLM's bias is dropped.
    assert set(trained) - {f"model.{k}" for k in connected.state} == {"mlm_bias"}
    assert set(connected.parameters.values()) == {f"veco:model.{k}" for k in connected.state}
    for key, value in connected.state.items():
        torch.testing.assert_close(value, trained[f"model.{key}"], rtol=0, atol=0)
    model_dir = write_seq2seq_dir(out, connected, spm_model=spm)
    state, info = load_seq2seq_state(model_dir)
    assert info.meta["mode"] == "veco" and info.meta["parent_runs"] == {"veco": run_id}
    return state, info


def test_veco_zero2_reads_both_kinds_of_batch_and_connects(
    mixed_shards: Path, launch_data: dict, tmp_path: Path
) -> None:
    """Three steps with a checkpoint at step 2: the ranks draw monolingual and parallel
    batches, the four terms are logged, the run is tagged as its stage and system, and it
    connects as a sequence-to-sequence model that names it as its parent."""
    out = tmp_path / "veco"
    args = ("--steps", "3", "--save-interval", "2", "--log-sample-ids")
    result = launch(_veco(mixed_shards, launch_data["spm"], out, *args, zero=2))
    check_finished(result, out, 3)
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert sorted(losses(out)) == [1, 2, 3]
    assert all(0 < loss < 40 for loss in losses(out).values())  # four terms of about ln V

    # Sentence ids carry the index of their language in the manifest's sorted names.
    names = sorted(json.loads((mixed_shards / "manifest.json").read_text())["languages"])
    drawn = set()
    for path in out.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            drawn |= {names[i >> 56] for i in json.loads(line)["ids"]}
    assert "en-de" in drawn and drawn & {"en", "de"}, drawn

    client, run = mlflow_run(out)
    tags = run.data.tags
    assert (tags["stage"], tags["system"], tags["interface"]) == ("veco", "VECO", "none")
    for name in ("is_mlm_x", "is_mlm_y", "cs_mlm_x", "cs_mlm_y", "veco_parallel_batch"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 3, name
    _connected_model(out, launch_data["spm"], tmp_path / "model", run.info.run_id)


def test_veco_zero3_connects_into_a_translation_model(
    mixed_shards: Path, launch_data: dict, tmp_path: Path
) -> None:
    """Under ZeRO-3 (parameters partitioned, gathered per module call) the ranks stay in
    lockstep whichever kind of batch each draws; the gathered model translates: its
    fine-tuning loss starts from the pre-trained decoder's output layer."""
    from megasemface.data.text.tokenizer import Tokenizer
    from megasemface.models.translation import TranslationModel
    from megasemface.objectives.sequences import SequenceBatch, SpecialTokens

    out = tmp_path / "veco"
    result = launch(_veco(mixed_shards, launch_data["spm"], out, "--steps", "2", zero=3))
    check_finished(result, out, 2)
    _, run = mlflow_run(out)
    assert run.data.tags["stage"] == "veco"
    state, info = _connected_model(out, launch_data["spm"], tmp_path / "model", run.info.run_id)

    tokenizer = Tokenizer.load(launch_data["spm"])
    model = TranslationModel(
        info.model, SpecialTokens.from_tokenizer(tokenizer), label_smoothing=0.1
    ).eval()
    model.model.load_state_dict(state)
    src, tgt = tokenizer.encode(["Open the file", "Datei öffnen"])

    def side(ids: list[int], lang: str) -> SequenceBatch:
        index = torch.tensor([tokenizer.languages.index(lang)])
        return SequenceBatch(torch.tensor([ids]), torch.tensor([len(ids)]), index)

    with torch.no_grad():
        loss = model.translation_loss(side(src, "en"), side(tgt, "de")).loss
    assert torch.isfinite(loss) and 0 < float(loss) < 2 * math.log(len(tokenizer))
