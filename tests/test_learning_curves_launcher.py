"""tools/learning_curves.py end to end: XLM, CL-SemFace and VQ-SemFace pre-trained through the
pipeline's launcher (2 processes over gloo) on the same shards, their curves read back from
MLflow into a table and a plot, with their validation MLM and decoder loss; a second call
reuses the runs, and without tracking the same curves come from the runs' logs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megasemface.cli.learning_curves import main
from megasemface.tracking.compare import metric_history, select_runs

pytestmark = pytest.mark.launcher

SYSTEMS = {"xlm": "XLM", "cl": "CL-SemFace", "vq": "VQ-SemFace"}


def _table(markdown: str) -> dict[str, dict[int, float]]:
    """The step table of curves.md: column name -> {step: value}."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = next(i for i, line in enumerate(lines) if line.startswith("| step |"))
    names = [cell.strip() for cell in lines[header].strip("|").split("|")][1:]
    columns: dict[str, dict[int, float]] = {name: {} for name in names}
    for line in lines[header + 1 :]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name, cell in zip(names, cells[1:], strict=True):
            if cell != "-":
                columns[name][int(cells[0])] = float(cell)
    return columns


@pytest.mark.slow
def test_three_systems_side_by_side_then_reused_and_read_from_logs(
    tmp_path: Path, launch_data: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "curves"
    args = ["--workdir", str(workdir), "--shards", str(launch_data["mono"])]
    args += ["--spm-model", str(launch_data["spm"]), "--cl-table", str(launch_data["cl"])]
    args += ["--steps", "4", "--log-every", "2", "--max-tokens", "512", "--procs", "2"]
    args += ["--valid-prefix", str(launch_data["valid"]), "--valid-every", "2"]
    args += ["--valid-sentences", "20"]
    assert main(args) == 0
    first = capsys.readouterr().out
    markdown = (workdir / "curves.md").read_text()
    assert f"Uniform guess: ln 1,000 = {math.log(1000):.2f} nats" in markdown
    table = _table(markdown)
    assert list(table) == [
        "XLM: valid MLM",
        "XLM: MLM",
        "CL-SemFace: valid MLM",
        "CL-SemFace: MLM",
        "CL-SemFace: valid dec_clm",
        "VQ-SemFace: valid MLM",
        "VQ-SemFace: MLM",
        "VQ-SemFace: valid dec_clm",
    ]
    assert all(sorted(values) == [2, 4] for values in table.values())
    assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table holds what each run logged to MLflow.
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    for key, display in SYSTEMS.items():
        (run,) = select_runs(uri, tags={"system": display}, lineage=False)
        assert run.name == f"pretrain-{key}"
        columns = (("enc_mlm", "MLM"), ("valid_enc_mlm", "valid MLM"))
        for metric, column in (*columns, ("valid_dec_clm", "valid dec_clm")):
            logged = dict(metric_history(run, metric))
            if key == "xlm" and metric == "valid_dec_clm":
                assert not logged  # the encoder stage has no decoder
                continue
            shown = table[f"{display}: {column}"]
            assert shown == {step: round(value, 2) for step, value in logged.items()}
    (report,) = select_runs(uri, tags={"stage": "report"}, lineage=False)
    assert "| step | XLM: valid MLM | XLM: MLM |" in report.tags["mlflow.note.content"]
    (vq,) = [line for line in markdown.splitlines() if line.startswith("| VQ-SemFace | 4 |")]
    assert vq.split("|")[7].strip() != "-"  # the codewords' perplexity on the validation text
    assert f"the comparison is MLflow run {report.run_id}" in first

    # Again: every run is reused, nothing trains, the same table.
    assert main(args) == 0
    second = capsys.readouterr().out
    for key in SYSTEMS:
        assert f"reusing {workdir / 'runs' / f'pretrain-{key}'} (finished, 4 steps)" in second
    assert "step 1/" not in second
    assert (workdir / "curves.md").read_text() == markdown

    # Without tracking the curves come from the runs' logs: the same values, to the three
    # decimals the progress line prints.
    assert main([*args, "--no-tracking"]) == 0
    third = capsys.readouterr().out
    assert "MLflow run" not in third
    from_logs = _table((workdir / "curves.md").read_text())
    assert list(from_logs) == list(table)
    for name, values in table.items():
        assert from_logs[name] == pytest.approx(values, abs=0.0101)  # both rounded
