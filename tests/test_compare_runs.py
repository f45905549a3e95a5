"""Comparing runs of a real MLflow SQLite store: selection, tables, lineage, plots and the CLI."""

from __future__ import annotations

import csv
import io
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("matplotlib")

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from megasemface.cli.compare_runs import main
from megasemface.tracking.compare import (
    CompareError,
    RunRecord,
    format_lineage,
    format_table,
    metric_history,
    metric_value,
    plot_bars,
    plot_curves,
    resolve_param_key,
    resolve_tracking_uri,
    select_runs,
)
from megasemface.tracking.tracker import flatten_params

ROOT = Path(__file__).resolve().parents[1]
START_MS = 1_780_000_000_000  # fixed start times: durations and ordering are deterministic
MISSING_PARENT = "0" * 32


@dataclass(frozen=True)
class Store:
    """The module's MLflow store and the ids of its runs by name."""

    uri: str
    db: Path
    ids: dict[str, str]


# name, experiment, tags, parents by role, metrics {key: [(step, value), ...]}, status
_RUNS: list[tuple[str, str, dict[str, str], dict[str, str], dict[str, list], str]] = [
    ("vq-enc", "pretrain", {"stage": "encoder", "interface": "vq"}, {}, {}, "FINISHED"),
    ("vq-dec", "pretrain", {"stage": "decoder", "interface": "vq"}, {"encoder": "vq-enc"}, {},
     "FINISHED"),
    ("cl-enc", "pretrain", {"stage": "encoder", "interface": "cl"}, {}, {}, "FINISHED"),
    ("cl-dec", "pretrain", {"stage": "decoder", "interface": "cl"}, {}, {}, "FINISHED"),
    ("xlm", "pretrain", {"stage": "joint", "interface": "none"}, {}, {}, "FINISHED"),
    ("mbart", "pretrain", {"stage": "mbart", "interface": "none"}, {}, {}, "FINISHED"),
    ("ft-transformer-en-de", "finetune", {"system": "Transformer", "direction": "en-de"}, {},
     {"test_bleu": [(0, 20.5)], "test_chrf": [(0, 48.25)]}, "FINISHED"),
    ("ft-xlm-en-de", "finetune", {"system": "XLM", "direction": "en-de"}, {"init": "xlm"},
     {"test_bleu": [(0, 24.0)], "test_chrf": [(0, 51.0)]}, "FINISHED"),
    ("ft-mbart-en-de", "finetune", {"system": "mBART", "direction": "en-de"}, {"init": "mbart"},
     {"test_bleu": [(0, 25.0)], "test_chrf": [(0, 52.0)]}, "FINISHED"),
    ("ft-cl-en-de", "finetune", {"system": "CL-SemFace", "direction": "en-de"},
     {"encoder": "cl-enc", "decoder": "cl-dec"},
     {"test_bleu": [(0, 26.5)], "test_chrf": [(0, 53.5)]}, "FINISHED"),
    ("ft-vq-en-de", "finetune", {"system": "VQ-SemFace", "direction": "en-de"},
     {"encoder": "vq-enc", "decoder": "vq-dec"},
     {"test_bleu": [(0, 27.25)], "test_chrf": [(0, 54.0)]}, "FINISHED"),
    ("ft-transformer-en-fr", "finetune", {"system": "Transformer", "direction": "en-fr"}, {},
     {"test_bleu": [(0, 30.0)], "test_chrf": [(0, 57.0)]}, "FINISHED"),
    ("ft-vq-en-fr", "finetune", {"system": "VQ-SemFace", "direction": "en-fr"},
     {"encoder": "vq-enc", "decoder": "vq-dec"},
     {"test_bleu": [(0, 33.5)], "test_chrf": [(0, 60.0)]}, "FINISHED"),
    # Still running, its encoder run gone from the store, no test scores yet.
    ("ft-orphan", "finetune", {"system": "VQ-SemFace", "direction": "en-de"},
     {"encoder": MISSING_PARENT}, {}, "RUNNING"),
]  # fmt: skip


def _loss(offset: float) -> list[tuple[int, float]]:
    return [(step, offset + 10.0 / step) for step in (1, 2, 5, 10, 20)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Pre-training parents and fine-tuned children, logged as the trainer logs them.

    Made once: creating an MLflow SQLite schema takes seconds.
    """
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    uri = f"sqlite:///{db}"
    client = MlflowClient(uri)
    experiments = {name: client.create_experiment(name) for name in ("pretrain", "finetune")}
    ids: dict[str, str] = {}
    for i, (name, experiment, tags, parents, metrics, status) in enumerate(_RUNS):
        finetune = experiment == "finetune"
        all_tags = {"git_commit": "abc123", **tags}
        if finetune:
            interface = {"CL-SemFace": "cl", "VQ-SemFace": "vq"}.get(tags["system"], "none")
            all_tags.update(stage="finetune", interface=interface)
        for role, parent in parents.items():
            all_tags[f"parent_{role}_run"] = ids.get(parent, parent)
        start = START_MS + i * 10_000_000
        run = client.create_run(
            experiments[experiment], start_time=start, tags=all_tags, run_name=name
        )
        run_id = ids[name] = run.info.run_id
        config = {
            "train": {"stage": all_tags["stage"], "preset": "tiny", "lr": 0.001, "seed": i},
            "model": {"d_model": 64},
            "deepspeed": {"optimizer": {"params": {"lr": 0.001}}},
        }
        history = {"loss": _loss(float(i)), "lr": [(20, 0.001)], **metrics}
        if finetune:
            history["valid_bleu"] = [(10, 18.0 + i), (20, 22.0 + i), (30, 21.0 + i)]
        points = [
            Metric(key, value, start + step, step)
            for key, values in history.items()
            for step, value in values
        ]
        params = [Param(k, v) for k, v in flatten_params(config).items()]
        client.log_batch(run_id, metrics=points, params=params, synchronous=True)
        if status != "RUNNING":
            client.set_terminated(run_id, status, end_time=start + 3_725_000)
    # A store damaged by hand: two runs naming each other as parent, a parent deleted.
    broken = client.create_experiment("broken")
    for k, name in enumerate(("loop-a", "loop-b", "gone", "child-of-gone")):
        start = START_MS * 2 + k
        ids[name] = client.create_run(broken, run_name=name, start_time=start).info.run_id
    client.set_tag(ids["loop-a"], "parent_init_run", ids["loop-b"])
    client.set_tag(ids["loop-b"], "parent_init_run", ids["loop-a"])
    client.set_tag(ids["gone"], "stage", "encoder")
    client.set_tag(ids["child-of-gone"], "parent_encoder_run", ids["gone"])
    client.delete_run(ids["gone"])
    return Store(uri, db, ids)


@pytest.fixture(autouse=True)
def _no_user_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A user's MLFLOW_TRACKING_URI must not decide which store a test reads."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield


def _names(records: list[RunRecord]) -> list[str]:
    return [r.name for r in records]


def _by_name(records: list[RunRecord]) -> dict[str, RunRecord]:
    return {r.name: r for r in records}


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _distinct_colours(path: Path) -> int:
    from matplotlib.image import imread

    pixels = imread(path)
    return len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()})


# Selection -----------------------------------------------------------------------------------


def test_select_by_experiment(store: Store) -> None:
    pretrain = select_runs(store.uri, experiments=["pretrain"])
    assert _names(pretrain) == ["vq-enc", "vq-dec", "cl-enc", "cl-dec", "xlm", "mbart"]
    assert {r.experiment for r in pretrain} == {"pretrain"}
    both = select_runs(store.uri, experiments=["pretrain", "finetune"])
    assert _names(both) == [name for name, *_ in _RUNS]
    broken = select_runs(store.uri, experiments=["broken"])
    assert _names(broken) == ["loop-a", "loop-b", "child-of-gone"]  # deleted runs are left out
    assert _names(select_runs(store.uri)) == _names(both + broken)  # no experiment: all of them

    record = _by_name(pretrain)["vq-enc"]
    assert record.params["train.preset"] == "tiny"
    assert record.params["model.d_model"] == "64"
    assert record.metrics["loss"] == pytest.approx(10.0 / 20)  # last point, step 20
    assert record.duration_s == pytest.approx(3725.0)
    assert record.status == "FINISHED"


def test_select_by_tags_filter_and_run_ids(store: Store) -> None:
    finetune = select_runs(store.uri, tags={"stage": "finetune"})
    assert len(finetune) == 8
    en_fr = select_runs(store.uri, tags={"stage": "finetune", "direction": "en-fr"})
    assert _names(en_fr) == ["ft-transformer-en-fr", "ft-vq-en-fr"]
    good = select_runs(store.uri, filter_string="metrics.test_bleu > 26")
    assert _names(good) == ["ft-cl-en-de", "ft-vq-en-de", "ft-transformer-en-fr", "ft-vq-en-fr"]
    vq = select_runs(store.uri, experiments=["finetune"], tags={"interface": "vq"})
    assert _names(vq) == ["ft-vq-en-de", "ft-vq-en-fr", "ft-orphan"]

    chosen = [store.ids["ft-vq-en-fr"], store.ids["vq-enc"], store.ids["ft-xlm-en-de"]]
    assert _names(select_runs(store.uri, run_ids=chosen)) == [
        "ft-vq-en-fr",
        "vq-enc",
        "ft-xlm-en-de",
    ]
    narrowed = select_runs(store.uri, run_ids=chosen, tags={"stage": "finetune"})
    assert _names(narrowed) == ["ft-vq-en-fr", "ft-xlm-en-de"]
    assert select_runs(store.uri, tags={"stage": "nothing-like-this"}) == []


def test_bad_selection_errors(store: Store, tmp_path: Path) -> None:
    with pytest.raises(CompareError, match=r"no experiment named 'pretrian'.*finetune, pretrain"):
        select_runs(store.uri, experiments=["pretrian"])
    with pytest.raises(CompareError, match=f"run '{MISSING_PARENT}' does not exist"):
        select_runs(store.uri, run_ids=[MISSING_PARENT])
    with pytest.raises(CompareError, match="MLflow rejected the filter"):
        select_runs(store.uri, filter_string="tags.stage ==")

    with pytest.raises(CompareError, match="--tracking-uri"):
        resolve_tracking_uri(None)
    missing = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(CompareError, match="no MLflow database"):
        resolve_tracking_uri(f"sqlite:///{missing}")
    assert not missing.parent.exists()  # a typo must not create an empty store
    with pytest.raises(CompareError, match="neither a tracking URI"):
        resolve_tracking_uri(tmp_path)
    # A training output directory or its mlflow.db file stand for the store.
    assert resolve_tracking_uri(store.db.parent) == f"sqlite:///{store.db.resolve()}"
    assert resolve_tracking_uri(store.db) == f"sqlite:///{store.db.resolve()}"


def test_lineage_follows_parents_and_shows_missing_ones(store: Store) -> None:
    runs = _by_name(select_runs(store.uri, tags={"stage": "finetune"}))
    assert format_lineage(runs["ft-vq-en-de"].lineage) == (
        "encoder: vq-enc (encoder), decoder: vq-dec (decoder) [encoder: vq-enc (encoder)]"
    )
    assert format_lineage(runs["ft-cl-en-de"].lineage) == (
        "encoder: cl-enc (encoder), decoder: cl-dec (decoder)"
    )
    assert format_lineage(runs["ft-xlm-en-de"].lineage) == "init: xlm (joint)"
    assert format_lineage(runs["ft-transformer-en-de"].lineage) == ""
    assert format_lineage(runs["ft-orphan"].lineage) == f"encoder: missing run {MISSING_PARENT}"
    broken = _by_name(select_runs(store.uri, experiments=["broken"]))
    assert format_lineage(broken["loop-a"].lineage) == "init: loop-b [init: loop-a [cycle]]"
    assert format_lineage(broken["child-of-gone"].lineage) == "encoder: gone (encoder, deleted)"
    assert runs["ft-vq-en-de"].parent_runs == {
        "encoder": store.ids["vq-enc"],
        "decoder": store.ids["vq-dec"],
    }
    assert (
        select_runs(store.uri, run_ids=[store.ids["ft-vq-en-de"]], lineage=False)[0].lineage == ()
    )


# Tables --------------------------------------------------------------------------------------


def test_csv_table_reads_back(store: Store) -> None:
    records = select_runs(store.uri, tags={"stage": "finetune"})
    columns = ["name", "tags.system", "params.train.preset", "metrics.test_bleu", "status",
               "duration", "lineage"]  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(format_table(records, columns, "csv"))))
    assert list(rows[0]) == ["run", "system", "train.preset", "test_bleu", "status", "duration",
                             "lineage"]  # fmt: skip
    rows_by_run = {row["run"]: row for row in rows}
    assert len(rows) == 8
    vq = rows_by_run["ft-vq-en-de"]
    assert (vq["system"], vq["train.preset"], vq["status"]) == ("VQ-SemFace", "tiny", "FINISHED")
    assert float(vq["test_bleu"]) == 27.25
    assert float(vq["duration"]) == 3725.0
    assert vq["lineage"].startswith("encoder: vq-enc (encoder), decoder: vq-dec")
    orphan = rows_by_run["ft-orphan"]
    assert (orphan["test_bleu"], orphan["duration"], orphan["status"]) == ("", "", "RUNNING")
    assert orphan["lineage"] == f"encoder: missing run {MISSING_PARENT}"


def test_text_and_markdown_tables(store: Store) -> None:
    records = select_runs(store.uri, tags={"stage": "finetune", "direction": "en-fr"})
    records += select_runs(store.uri, run_ids=[store.ids["ft-orphan"]])
    columns = ["name", "tags.system", "metrics.test_bleu", "duration"]
    text = format_table(records, columns, "table").splitlines()
    assert text[0].split() == ["run", "system", "test_bleu", "duration"]
    assert set(text[1]) == {"-", " "}
    assert text[2].split() == ["ft-transformer-en-fr", "Transformer", "30", "1h02m05s"]
    assert text[3].split() == ["ft-vq-en-fr", "VQ-SemFace", "33.5", "1h02m05s"]
    assert text[4].split() == ["ft-orphan", "VQ-SemFace", "-", "-"]
    # Numbers are right-aligned: their last characters line up.
    assert len({len(line) for line in text[2:4]}) == 1

    markdown = format_table(records, columns, "markdown").splitlines()
    assert markdown[0] == "| run | system | test_bleu | duration |"
    assert markdown[1] == "| --- | --- | ---: | ---: |"
    assert markdown[3] == "| ft-vq-en-fr | VQ-SemFace | 33.5 | 1h02m05s |"
    assert markdown[4] == "| ft-orphan | VQ-SemFace | - | - |"

    with pytest.raises(CompareError, match="unknown column 'bleu'"):
        format_table(records, ["bleu"], "table")
    with pytest.raises(CompareError, match="unknown table format"):
        format_table(records, columns, "html")  # type: ignore[arg-type]


def test_metric_aggregation_and_history(store: Store) -> None:
    (record,) = select_runs(store.uri, run_ids=[store.ids["ft-xlm-en-de"]])
    i = 7  # its position in _RUNS: valid_bleu is 18+i, 22+i, 21+i at steps 10, 20, 30
    assert metric_value(record, "valid_bleu") == 21.0 + i
    assert metric_value(record, "valid_bleu", "max") == 22.0 + i
    assert metric_value(record, "valid_bleu", "min") == 18.0 + i
    assert metric_value(record, "no_such_metric", "max") is None
    assert [step for step, _ in metric_history(record, "loss")] == [1, 2, 5, 10, 20]
    csv_text = format_table([record], ["metrics.valid_bleu"], "csv", metric_agg="max")
    assert csv_text.splitlines() == ["valid_bleu (max)", str(22.0 + i)]


def test_param_keys_resolve_by_suffix(store: Store) -> None:
    records = select_runs(store.uri, experiments=["pretrain"])
    assert resolve_param_key(records, "preset") == "train.preset"
    assert resolve_param_key(records, "model.d_model") == "model.d_model"
    assert resolve_param_key(records, "no_such_param") == "no_such_param"
    with pytest.raises(
        CompareError, match=r"ambiguous \(deepspeed.optimizer.params.lr, train.lr\)"
    ):
        resolve_param_key(records, "lr")


# Plots ---------------------------------------------------------------------------------------


def test_plots_are_png_images(store: Store, tmp_path: Path) -> None:
    records = select_runs(store.uri)
    curves = plot_curves(records, tmp_path / "plots" / "loss.png")
    assert _png_size(curves) == (800, 500)
    assert _distinct_colours(curves) > 10  # curves, not an empty canvas

    bars = plot_bars(records, tmp_path / "bleu.png")  # two directions: grouped bars
    width, height = _png_size(bars)
    assert width > height > 0
    assert _distinct_colours(bars) > 5
    en_de = [r for r in records if r.tags.get("direction") == "en-de"]
    single = plot_bars(en_de, tmp_path / "chrf.png", metric="test_chrf")
    assert _png_size(single)[0] > 0

    # Two seeds of one system: their mean, with the range as an error bar.
    tags = {"system": "VQ-SemFace", "direction": "en-de"}
    seeds = [
        RunRecord(f"{i:032x}", f"vq-seed{i}", "x", "FINISHED", 0, 1, {}, tags,
                  {"test_bleu": value}, store.uri)
        for i, value in enumerate((26.0, 28.0))
    ]  # fmt: skip
    assert _png_size(plot_bars(seeds + en_de, tmp_path / "seeds.png"))[1] == 500

    with pytest.raises(CompareError, match="none of the 6 runs logged metric 'test_bleu'"):
        plot_bars([r for r in records if r.experiment == "pretrain"], tmp_path / "x.png")
    with pytest.raises(CompareError, match="logged: loss, lr"):
        plot_curves(records[:1], tmp_path / "y.png", metric="enc_mlm")
    assert not (tmp_path / "x.png").exists()


# Command line ----------------------------------------------------------------------------------


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compare_runs.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_cli_table_and_plots(store: Store, tmp_path: Path) -> None:
    result = _tool(
        "--tracking-uri", store.uri, "--tag", "stage=finetune", "--format", "csv",
        "--param", "preset", "--plot-loss", str(tmp_path / "loss.png"),
        "--plot-bleu", str(tmp_path / "bleu.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["run", "system", "stage", "interface", "direction", "train.preset",
                             "loss", "valid_bleu", "test_bleu", "test_chrf", "registered",
                             "status", "duration", "lineage"]  # fmt: skip
    assert [row["run"] for row in rows] == [name for name, *_ in _RUNS[6:]]
    assert float(rows[4]["test_bleu"]) == 27.25
    assert "1 run(s) without metric 'test_bleu' left out of the plot: ft-orphan" in result.stderr
    for png in ("loss.png", "bleu.png"):
        assert _png_size(tmp_path / png)[0] > 0


def test_cli_no_match_is_a_message_and_status_1(store: Store) -> None:
    result = _tool("--tracking-uri", store.uri, "--experiment", "pretrain", "--tag", "stage=x")
    assert result.returncode == 1
    assert "no runs matched in experiment(s) pretrain" in result.stderr
    assert "tags.`stage` = 'x'" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_in_process(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Pre-training runs: blank default columns (system, BLEU) are left out of the text table.
    out = tmp_path / "pretrain.md"
    assert main(["--tracking-uri", str(store.db.parent), "--experiment", "pretrain",
                 "--format", "markdown", "--output", str(out)]) == 0  # fmt: skip
    lines = out.read_text().splitlines()
    assert lines[0] == "| run | stage | interface | loss | status | duration | lineage |"
    assert (
        lines[3]
        == "| vq-dec | decoder | vq | 1.5 | FINISHED | 1h02m05s | encoder: vq-enc (encoder) |"
    )

    assert main(["--tracking-uri", store.uri, "--columns", "name,metrics.valid_bleu",
                 "--metric-agg", "max", "--run-id", store.ids["ft-mbart-en-de"]]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines()[2].split() == ["ft-mbart-en-de", "30"]

    assert main(["--tracking-uri", store.uri, "--metric", "bleu_typo", "--run-id",
                 store.ids["xlm"]]) == 0  # fmt: skip
    assert "no selected run has metric 'bleu_typo'" in capsys.readouterr().err

    assert main(["--tracking-uri", store.uri, "--param", "lr"]) == 2
    assert "param 'lr' is ambiguous" in capsys.readouterr().err
    assert main(["--tag", "stage"]) == 2
    assert "--tracking-uri" in capsys.readouterr().err
    assert main(["--tracking-uri", store.uri, "--tag", "stage"]) == 2
    assert "give KEY=VALUE" in capsys.readouterr().err
