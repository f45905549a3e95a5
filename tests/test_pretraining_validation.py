"""Validation during pre-training (training/units/pretraining_validation.py): the figures a
launched VQ-SemFace joint run logs equal a direct computation from its last checkpoint; and
the encoder MLM of a finished run (evaluation/encoder_mlm.py, tools/valid_mlm.py) equals the
``valid_enc_mlm`` its training logged at its last step, for XLM's encoder stage and CL- and
VQ-SemFace's joint stage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from launch import ROOT, chain, check_finished, launch, mlflow_run, train_command

from megasemface.checkpoints.consolidate import load_stage
from megasemface.cli.valid_mlm import main as valid_mlm_main
from megasemface.data.text.lines import read_lines
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.evaluation.encoder_mlm import METRIC, EncoderMlmError, encoder_mlm
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
    # The finished run's encoder MLM, from its consolidated checkpoint with the plain model.
    posthoc = encoder_mlm(out, _texts(launch_data), max_sentences=MAX_SENTENCES)
    assert posthoc.step == 4 and posthoc.stage == "joint" and posthoc.interface == "vq"
    assert posthoc.mlm == pytest.approx(mlm[4], rel=1e-5, abs=1e-5)
    print(f"vq: logged {mlm[4]:.7f}, post hoc {posthoc.mlm:.7f}")  # shown with -s


def _texts(launch_data: dict) -> dict[str, Path]:
    return {lang: Path(f"{launch_data['valid']}.{lang}") for lang in ("en", "de")}


def test_a_finished_run_s_encoder_mlm_is_its_last_validation(
    launch_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """XLM's encoder stage (no interface) and CL-SemFace's joint stage, validated at their
    last step only, in one launch: the post-hoc figure is the logged one, per language the
    mean of its own batches; the command line writes it and logs it to the run."""
    steps = "3"
    runs = {"xlm": ["--stage", "encoder", "--interface", "none"]}
    runs["cl"] = ["--stage", "joint", "--interface", "cl", "--cl-table", str(launch_data["cl"])]
    valid = ["--valid-prefix", str(launch_data["valid"]), "--valid-interval", "1000"]
    valid += ["--valid-max-sentences", str(MAX_SENTENCES)]
    data = {"shards": launch_data["mono"], "spm": launch_data["spm"]}
    config = ROOT / "ds_configs" / "cpu_fp32_zero2.json"
    commands = [
        train_command(
            data, tmp_path / name, *args, "--steps", steps, *valid, config=config, live=True
        )
        for name, args in runs.items()
    ]
    result = launch(chain(commands))
    texts = _texts(launch_data)
    for name in runs:
        out = tmp_path / name
        check_finished(result, out, int(steps))
        client, run = mlflow_run(out)
        (logged,) = client.get_metric_history(run.info.run_id, "valid_enc_mlm")
        posthoc = encoder_mlm(out, texts, max_sentences=MAX_SENTENCES)
        assert (logged.step, posthoc.step, posthoc.mlflow_run_id) == (3, 3, run.info.run_id)
        assert posthoc.mlm == pytest.approx(logged.value, rel=1e-5, abs=1e-5), name
        with capsys.disabled():  # shown with -s
            print(f"{name}: logged {logged.value:.7f}, post hoc {posthoc.mlm:.7f}")
        assert [x.lang for x in posthoc.languages] == ["en", "de"]  # the tokenizer's order
        assert all(x.sentences == MAX_SENTENCES and x.targets > 0 for x in posthoc.languages)
        summed = sum(x.mlm * x.targets for x in posthoc.languages)
        assert summed / sum(x.targets for x in posthoc.languages) == pytest.approx(posthoc.mlm)
    capsys.readouterr()
    # The command line, on the XLM run: the table, the JSON, the metrics at the run's step.
    xlm, written = tmp_path / "xlm", tmp_path / "xlm-mlm.json"
    args = ["--checkpoint", str(xlm), "--max-sentences", str(MAX_SENTENCES)]
    args += [a for lang, path in texts.items() for a in ("--text", f"{lang}:{path}")]
    assert valid_mlm_main([*args, "--output", str(written), "--log-to-run", str(xlm)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(written.read_text())
    assert f"all: {figures['mlm']:.4f} nats" in printed
    client, run = mlflow_run(xlm)
    (metric,) = client.get_metric_history(run.info.run_id, METRIC)
    assert (metric.step, metric.value) == (3, pytest.approx(figures["mlm"]))
    (en,) = client.get_metric_history(run.info.run_id, f"{METRIC}_en")
    assert en.value == pytest.approx(figures["languages"][0]["mlm"])
    # Bad input: one line, status 2.
    fr = ["--checkpoint", str(xlm), "--text", f"fr:{texts['en']}"]
    assert valid_mlm_main(fr) == 2
    err = capsys.readouterr().err
    assert "not in the SentencePiece model" in err and err.count("\n") == 1, err
    with pytest.raises(EncoderMlmError, match="max_sentences must be >= 1"):
        encoder_mlm(xlm, texts, max_sentences=0)


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
