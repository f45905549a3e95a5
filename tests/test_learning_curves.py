"""The learning-curve comparison's options and table (its runs are
test_learning_curves_launcher.py's)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megasemface.cli.learning_curves import main
from megasemface.pipeline.learning_curves import CurvesConfig
from megasemface.tracking.compare import Curve, curves_table


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--stpes", "3"], "unknown option --stpes (did you mean --steps?)"),
        (["--systems", "transformer"], "transformer has no pre-training, no encoder MLM"),
        (["--systems", "mbart"], "mbart has the mbart stage, no encoder MLM"),
        (["--systems", "vq-bridge"], "vq-bridge only connects vq's pre-training"),
        (["--systems", "vq-ras"], "vq-ras substitutes words"),
        (["--systems", "vq,xlm,vq"], "--systems: vq is given more than once"),
        (["--systems", "nope"], "unknown system 'nope'"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--model", "d_mdl=8"], "d_mdl"),
    ],
)
def test_bad_options_stop_in_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str, tmp_path: Path
) -> None:
    line = _error(capsys, "--workdir", str(tmp_path / "w"), "--procs", "2", *args)
    assert line.startswith("learning_curves: error: ") and expected in line, line
    assert not (tmp_path / "w").exists()  # nothing started


def test_missing_data_names_the_option_and_what_builds_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no runs/demo here
    line = _error(capsys, "--procs", "2")
    assert "--shards runs/demo/shards/mono: not found; make demo builds" in line
    line = _error(capsys, "--procs", "2", "--shards", str(tmp_path / "mine"))
    assert f"--shards {tmp_path / 'mine'}: not found; give --shards" in line


def test_the_learning_rate_defaults_to_the_budgets_for_the_preset() -> None:
    assert CurvesConfig(preset="paper").pretrain_lr == 1e-4
    assert CurvesConfig(preset="tiny").pretrain_lr == 1e-3
    assert CurvesConfig(preset="paper", lr=3e-4).pretrain_lr == 3e-4
    pipeline = CurvesConfig(preset="paper", max_tokens=512, steps=30).pipeline_config()
    assert (pipeline.model_preset, pipeline.max_tokens, pipeline.pretrain_steps) == (
        "paper",
        512,
        30,
    )


def test_the_table_shows_each_step_and_when_the_mlm_falls_below_uniform() -> None:
    uniform = math.log(1000)
    xlm = Curve("XLM", {"enc_mlm": {10: 7.2, 20: 6.5}, "tokens_per_s": {10: 900, 20: 1100}})
    vq = Curve(
        "VQ-SemFace",
        {"enc_mlm": {10: 7.4, 20: 7.1, 30: 6.8}, "dec_clm": {10: 7.0, 30: 6.1}},
    )
    text = curves_table([xlm, vq], 1000)
    assert f"ln 1,000 = {uniform:.2f} nats" in text
    assert "| XLM | 20 | - | 20 | 6.50 | - | - | 1,000 |" in text
    assert "| VQ-SemFace | 30 | - | 30 | 6.80 | dec_clm 6.10 | - | - |" in text
    assert "| step | XLM: MLM | VQ-SemFace: MLM | VQ-SemFace: dec_clm |" in text
    assert "| 20 | 6.50 | 7.10 | - |" in text
    assert "| 30 | - | 6.80 | 6.10 |" in text


def test_the_table_compares_validation_and_flags_collapsed_codewords() -> None:
    uniform = math.log(1000)
    vq = Curve(
        "VQ-SemFace",
        {
            "enc_mlm": {10: 7.4, 20: 7.1},
            "valid_enc_mlm": {10: uniform + 0.1, 20: uniform - 0.2},
            "dec_clm": {10: 7.0, 20: 6.1},
            "valid_dec_clm": {10: 6.9, 20: 6.0},
            "valid_enc_code_perplexity": {10: 120.0, 20: 480.0},
            "valid_enc_code_tokens": {10: 4_000.0, 20: 4_000.0},
            "valid_enc_codewords": {10: 102_400.0, 20: 102_400.0},
        },
    )
    text = curves_table([vq], 1000)
    # Below uniform from the first validation under it; the codewords' perplexity beside the
    # tenth of min(tokens, codewords) under which it reads as collapse.
    assert (
        f"| VQ-SemFace | 20 | {uniform - 0.2:.2f} | 20 | 7.10 | dec_clm 6.00 | 480 (400) |" in text
    )
    assert "| step | VQ-SemFace: valid MLM | VQ-SemFace: MLM | VQ-SemFace: valid dec_clm |" in text


def test_a_missing_validation_text_names_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shards, spm = tmp_path / "shards", tmp_path / "joint.model"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    spm.write_text("")
    data = ["--procs", "2", "--shards", str(shards), "--spm-model", str(spm)]
    line = _error(capsys, *data, "--valid-prefix", str(tmp_path / "valid"))
    assert f"--valid-prefix {tmp_path / 'valid'}: no valid.<lang> files" in line
    assert "--no-validation" in line
