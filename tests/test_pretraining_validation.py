"""Validation during pre-training (training/units/pretraining_validation.py): the figures a
launched VQ-SemFace joint run logs equal a direct computation from its last checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from launch import ROOT, launch, mlflow_run, train_command

from megasemface.checkpoints.consolidate import load_stage
from megasemface.data.text.lines import read_lines
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.interfaces.factory import build_interface
from megasemface.models.semface import SemFaceModel
from megasemface.nn.config import config_from_dict
from megasemface.objectives.objective import ObjectiveConfig
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens

MAX_SENTENCES = 40


def _direct(run: Path, valid: Path, spm: Path) -> dict[str, float]:
    """The last checkpoint's model in eval mode, sentence batches of 32 per language with the
    masks the validation seeds: its MLM and decoder loss per predicted token, and its argmax
    codewords' histogram."""
    state, meta = load_stage(run)
    tokenizer = Tokenizer.load(spm)
    special = SpecialTokens.from_tokenizer(tokenizer)
    config = config_from_dict(meta["model"])
    options = meta["train_config"]
    objective = ObjectiveConfig(
        **{
            name: options[name]
            for name in ("decoder_objective", "decoder_codes", "extractor_diversity")
        }
    )
    model = SemFaceModel(config, build_interface("vq", config), special, objective)
    model.load_state_dict(state)
    model.eval()
    sums = {"enc": [0.0, 0], "dec": [0.0, 0]}
    codes = []
    index = 0
    for lang_id, lang in enumerate(tokenizer.languages):
        lines = read_lines(Path(f"{valid}.{lang}"))[:MAX_SENTENCES]
        rows = [ids[: config.max_len - 2] for ids in tokenizer.encode(lines) if ids]
        for start in range(0, len(rows), 32):
            chunk = rows[start : start + 32]
            tokens = torch.full((len(chunk), max(map(len, chunk))), special.pad)
            for i, row in enumerate(chunk):
                tokens[i, : len(row)] = torch.tensor(row)
            batch = SequenceBatch(
                tokens, torch.tensor(list(map(len, chunk))), torch.full((len(chunk),), lang_id)
            )
            with torch.no_grad():
                enc = model.encoder_loss(batch, torch.Generator().manual_seed(12_345 + index))
                codes.append(model.interface.last_output.greedy_codes)
                dec = model.decoder_loss(batch, torch.Generator().manual_seed(12_345 + index))
            sums["enc"][0] += float(enc.components["enc_mlm"]) * enc.num_targets
            sums["enc"][1] += enc.num_targets
            sums["dec"][0] += float(dec.components["dec_clm"]) * dec.num_targets
            sums["dec"][1] += dec.num_targets
            index += 1
    _, counts = torch.unique(torch.cat(codes), return_counts=True)
    q = counts.double() / counts.sum()
    return {
        "valid_enc_mlm": sums["enc"][0] / sums["enc"][1],
        "valid_dec_clm": sums["dec"][0] / sums["dec"][1],
        "valid_enc_codes_used": float(counts.numel()),
        "valid_enc_code_perplexity": math.exp(float(-(q * q.log()).sum())),
        "valid_enc_code_tokens": float(counts.sum()),
        "valid_enc_codewords": float(model.interface.quantizer.num_codes),
    }


def test_a_joint_run_logs_its_validation_losses_and_codes(
    launch_data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cmd = train_command(
        {"shards": launch_data["mono"], "spm": launch_data["spm"]},
        out,
        "--stage", "joint", "--interface", "vq", "--steps", "4", "--log-interval", "2",
        "--valid-prefix", str(launch_data["valid"]), "--valid-interval", "2",
        "--valid-max-sentences", str(MAX_SENTENCES),
        config=ROOT / "ds_configs" / "cpu_fp32_zero2.json",
    )  # fmt: skip
    result = launch(cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shown = [x for x in result.stdout.splitlines() if x.startswith("validation at step")]
    assert [x.split(":")[0] for x in shown] == ["validation at step 2", "validation at step 4"]
    client, run = mlflow_run(out)
    expected = _direct(out, launch_data["valid"], launch_data["spm"])
    for name, value in expected.items():
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert sorted(history) == [2, 4], name
        assert history[4] == pytest.approx(value, rel=1e-5), name
    # The model learnt something between the two validations of the same sentences and masks.
    mlm = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "valid_enc_mlm")}
    assert mlm[2] != mlm[4]


def test_a_language_without_validation_text_stops_the_run(
    launch_data: dict, tmp_path: Path
) -> None:
    only_en = tmp_path / "valid"
    only_en.with_suffix(".en").write_text("A sentence.\n", encoding="utf-8")
    cmd = train_command(
        {"shards": launch_data["mono"], "spm": launch_data["spm"]},
        tmp_path / "run",
        "--stage", "encoder", "--interface", "none", "--steps", "2",
        "--valid-prefix", str(only_en),
        config=ROOT / "ds_configs" / "cpu_fp32_zero2.json",
    )  # fmt: skip
    result = launch(cmd)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"--valid-prefix: {only_en}.de not found" in output, output[-2000:]
    assert "Traceback" not in output, output[-3000:]
