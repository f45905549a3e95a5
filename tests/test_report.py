"""The pipeline's report: paper-shaped tables over seeds (mean ± std, gains) and sacreBLEU's
paired bootstrap p-values, read from a real MLflow SQLite store and real hypothesis files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from megasemface.evaluation.metrics import evaluate
from megasemface.pipeline.config import PipelineConfig, seeded
from megasemface.pipeline.report import (
    GridChoice,
    baseline_of,
    build_report,
    copy_scores,
    describe_seeds,
    grid_edges,
    paper_table,
)
from megasemface.pipeline.scores import collect_pairs, collect_systems, run_seed
from megasemface.tracking.compare import RunRecord, select_runs

DIRECTIONS = ["en-de", "de-en"]


def _record(key: str, display: str, en_de: float, de_en: float, seed: int = 0) -> RunRecord:
    return RunRecord(
        run_id=f"{key}-{seed}",
        name=f"run-{key}",
        experiment="e",
        status="FINISHED",
        start_time_ms=0,
        end_time_ms=1000,
        params={},
        tags={"system_key": key, "system": display, "setting": "supervised", "seed": str(seed)},
        metrics={"test_bleu_en-de": en_de, "test_bleu_de-en": de_en, "test_bleu": 0.0},
        tracking_uri="sqlite:///x.db",
    )


RECORDS = [
    _record("transformer", "Transformer", 1.0, 3.0),
    _record("xlm", "XLM", 4.0, 6.0),
    _record("vq", "VQ-SemFace", 6.5, 7.5),
]


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("| ").split(" | ")] for line in table.splitlines()[2:]]


def test_gains_are_measured_from_the_papers_baseline_row() -> None:
    assert baseline_of(RECORDS, "supervised").tags["system"] == "Transformer"
    assert baseline_of(RECORDS, "unsupervised").tags["system"] == "XLM"
    assert baseline_of(RECORDS[2:], "unsupervised").tags["system"] == "VQ-SemFace"

    systems = collect_systems(RECORDS, ["transformer", "xlm", "vq"], [0], "supervised")
    table = paper_table(systems, DIRECTIONS, systems[1])
    assert [row[-1] for row in _rows(table)] == ["-3.00", "-", "+2.00"]
    assert _rows(table)[2] == ["VQ-SemFace", "6.50", "7.50", "7.00", "+2.00"]  # one seed: plain
    assert paper_table(systems, DIRECTIONS).splitlines()[2].endswith("| 2.00 | - |")


def test_seeds_give_mean_and_sample_deviation_and_a_gain_of_means() -> None:
    vq = [(6.0, 7.0), (7.0, 9.0), (8.5, 8.0)]
    records = [_record("transformer", "Transformer", 1.0, 3.0, seed=s) for s in (0, 1, 2)]
    records += [_record("vq", "VQ-SemFace", a, b, seed=s) for s, (a, b) in enumerate(vq)]
    records.append(_record("vq", "VQ-SemFace", 50.0, 50.0, seed=7))  # a seed not asked for
    systems = collect_systems(records, ["transformer", "vq"], [0, 1, 2], "supervised")
    assert [s.seeds for s in systems] == [(0, 1, 2), (0, 1, 2)]
    bleu = systems[1].bleu(DIRECTIONS)
    assert bleu == {"en-de": [6.0, 7.0, 8.5], "de-en": [7.0, 9.0, 8.0], "avg": [6.5, 8.0, 8.25]}

    row = _rows(paper_table(systems, DIRECTIONS, seeds=[0, 1, 2]))[1]
    for cell, column in zip(row[1:4], ("en-de", "de-en", "avg"), strict=True):
        mean, std = statistics.fmean(bleu[column]), statistics.stdev(bleu[column])
        assert cell == f"{mean:.2f} ± {std:.2f}"
    assert row[4] == f"{statistics.fmean(bleu['avg']) - 2.0:+.2f}"
    # A system missing a seed says which it has.
    partial = collect_systems(records[:5], ["transformer", "vq"], [0, 1, 2], "supervised")
    assert _rows(paper_table(partial, DIRECTIONS, seeds=[0, 1, 2]))[1][0] == (
        "VQ-SemFace (seeds 0, 1)"
    )
    assert describe_seeds([0]) == "seed 0"
    assert describe_seeds([0, 1, 2]) == "mean ± std over 3 seeds: 0, 1, 2"


def test_a_runs_seed_is_its_tag_else_its_logged_config() -> None:
    record = _record("vq", "VQ-SemFace", 1.0, 1.0, seed=3)
    assert run_seed(record) == 3
    untagged = dataclasses.replace(record, tags={}, params={"train.seed": "0"})
    assert run_seed(untagged) == 0  # a run from before the seed tag, reused by a workdir
    assert run_seed(dataclasses.replace(record, tags={})) is None


def test_copying_the_source_is_scored_per_direction(tmp_path) -> None:
    prefix = tmp_path / "test"
    (tmp_path / "test.en").write_text("Open file %s\nQuit\nthe cat sat on the mat\n")
    (tmp_path / "test.de").write_text("Open file %s\nBeenden\ndie Katze sass auf der Matte\n")
    scores = copy_scores(prefix, DIRECTIONS)
    assert set(scores) == set(DIRECTIONS)
    assert scores["en-de"] == pytest.approx(scores["de-en"])  # BLEU of one copy either way
    assert 0 < scores["en-de"] < 100
    (tmp_path / "test.de").write_text((tmp_path / "test.en").read_text())
    assert copy_scores(prefix, DIRECTIONS) == pytest.approx({"en-de": 100.0, "de-en": 100.0})


def test_learning_rates_must_be_positive() -> None:
    from megasemface.pipeline.config import PipelineConfig

    for name in ("lr", "pretrain_lr"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            PipelineConfig(**{name: 0.0})


# The whole report from a real MLflow store and real hypothesis files ----------------------------

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "house", "red", "blue",
         "small", "big", "fast", "slow", "open", "file"]  # fmt: skip
SYSTEMS = {"transformer": ("Transformer", 0.5), "vq": ("VQ-SemFace", 0.42)}
"""key -> (row label, share of words each hypothesis gets wrong)."""
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Workdir:
    """A pipeline work directory as the pipeline leaves it: test set, runs, MLflow store."""

    path: Path
    uri: str
    test: Path


def _noisy(sentence: str, wrong: float, rng: random.Random) -> str:
    return " ".join(w if rng.random() > wrong else rng.choice(WORDS) for w in sentence.split())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Workdir:
    """Two systems x three seeds of supervised fine-tuning runs, logged as the pipeline logs
    them: tags, the seed in the config, per-direction test BLEU of the hypotheses it wrote.
    Made once: creating an MLflow SQLite schema takes seconds."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("workdir")
    rng = random.Random(0)
    test = root / "data" / "test"
    test.parent.mkdir()
    for lang in ("en", "de"):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) for _ in range(60)]
        test.with_suffix(f".{lang}").write_text("\n".join(lines) + "\n")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("megasemface-en-de")
    for seed in SEEDS:
        for key, (display, wrong) in SYSTEMS.items():
            name = seeded(f"supervised-{key}", seed)
            tags = {"stage": "finetune", "system": display, "system_key": key}
            tags.update(setting="supervised", seed=str(seed))
            run_id = client.create_run(experiment, run_name=name, tags=tags).info.run_id
            client.log_param(run_id, "train.seed", seed)
            bleu: dict[str, float] = {}
            for direction in DIRECTIONS:
                target = direction[-2:]
                references = test.with_suffix(f".{target}").read_text().splitlines()
                noisy = [_noisy(r, wrong + 0.03 * seed, rng) for r in references]
                out = root / "runs" / name / f"test.{direction}.{target}"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("\n".join(noisy) + "\n")
                bleu[direction] = evaluate(noisy, references).bleu.score
                client.log_metric(run_id, f"test_bleu_{direction}", bleu[direction])
            client.log_metric(run_id, "test_bleu", statistics.fmean(bleu.values()))
            client.log_metric(run_id, "loss", 1.0, step=1)
    return Workdir(root, uri, test)


@pytest.fixture(autouse=True)
def _sacrebleu_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A user's SACREBLEU_SEED or MLFLOW_TRACKING_URI must not decide what a test reads."""
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield


def _config(workdir: Workdir, seeds: tuple[int, ...]) -> PipelineConfig:
    return PipelineConfig(workdir=workdir.path, systems=tuple(SYSTEMS), seeds=seeds)


def _sacrebleu_cli(tmp_path: Path, references: list[str], *systems: list[str]) -> list[dict]:
    """``sacrebleu REF -i BASELINE SYSTEM -m bleu --paired-bs`` on files, as a user would."""
    files = []
    for i, lines in enumerate([references, *systems]):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "SACREBLEU_SEED"}
    command = [sys.executable, "-m", "sacrebleu", str(files[0]), "-i", *map(str, files[1:])]
    command += ["-m", "bleu", "--paired-bs", "--format", "json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def _hypotheses(workdir: Workdir, key: str, seeds: tuple[int, ...], direction: str) -> list[str]:
    target = direction[-2:]
    lines: list[str] = []
    for seed in seeds:
        path = workdir.path / "runs" / seeded(f"supervised-{key}", seed)
        lines += (path / f"test.{direction}.{target}").read_text().splitlines()
    return lines


def test_report_over_seeds_reads_mean_std_and_sacrebleus_paired_bootstrap(
    workdir: Workdir, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = build_report(_config(workdir, SEEDS), workdir.uri, workdir.path, workdir.test)
    printed = capsys.readouterr().out
    # Mean and standard deviation over seeds equal a direct computation on the logged scores.
    runs = select_runs(workdir.uri, tags={"system_key": "vq"})
    for direction in DIRECTIONS:
        values = [r.metrics[f"test_bleu_{direction}"] for r in runs]
        assert len(values) == 3
        assert report.bleu["supervised"]["VQ-SemFace"][direction] == pytest.approx(
            statistics.fmean(values)
        )
        assert report.std["supervised"]["VQ-SemFace"][direction] == pytest.approx(
            statistics.stdev(values)
        )
    # Each p-value is sacreBLEU's own paired bootstrap on the seeds' hypotheses concatenated.
    for direction in DIRECTIONS:
        references = workdir.test.with_suffix(f".{direction[-2:]}").read_text().splitlines()
        baseline = _hypotheses(workdir, "transformer", SEEDS, direction)
        system = _hypotheses(workdir, "vq", SEEDS, direction)
        _, cli = _sacrebleu_cli(tmp_path, references * 3, baseline, system)
        p_value = report.p_values["supervised"]["VQ-SemFace"][direction]
        assert p_value == cli["BLEU"]["p_value"]
        assert 1 / 1001 <= p_value < 1
    assert "Transformer" not in report.p_values["supervised"]  # the baseline row
    # The table: mean ± std with several seeds, the gain of means, p-values per direction.
    table = report.tables["supervised"]
    assert table.splitlines()[0] == "| system | en-de | de-en | avg | gain | p en-de | p de-en |"
    vq = _rows(table)[1]
    means, stds = report.bleu["supervised"]["VQ-SemFace"], report.std["supervised"]["VQ-SemFace"]
    assert vq[3] == f"{means['avg']:.2f} ± {stds['avg']:.2f}"
    gain = means["avg"] - report.bleu["supervised"]["Transformer"]["avg"]
    assert vq[4] == f"{gain:+.2f}"
    assert vq[5].rstrip("*") == f"{report.p_values['supervised']['VQ-SemFace']['en-de']:.4f}"
    assert _rows(table)[0][4:] == ["-", "-", "-"]
    markdown = report.markdown.read_text()
    for text in (table, "mean ± std over 3 seeds: 0, 1, 2", "bs:1000|seed:12345"):
        assert text in markdown and text in printed
    assert "concatenated, each seed paired with the same seed of Transformer" in markdown
    assert report.seeds == SEEDS
    assert all(path.stat().st_size > 0 for path in report.plots)
    print(table)  # the example in the brief's reply: pytest -s shows it


def test_report_of_one_seed_is_sacrebleus_test_of_two_files(
    workdir: Workdir, tmp_path: Path
) -> None:
    report = build_report(_config(workdir, (1,)), workdir.uri, workdir.path, workdir.test)
    table = report.tables["supervised"]
    assert "±" not in table
    (run,) = select_runs(workdir.uri, tags={"system_key": "vq", "seed": "1"})
    assert report.bleu["supervised"]["VQ-SemFace"]["en-de"] == run.metrics["test_bleu_en-de"]
    assert math.isnan(report.std["supervised"]["VQ-SemFace"]["en-de"])
    references = workdir.test.with_suffix(".de").read_text().splitlines()
    baseline = _hypotheses(workdir, "transformer", (1,), "en-de")
    _, cli = _sacrebleu_cli(
        tmp_path, references, baseline, _hypotheses(workdir, "vq", (1,), "en-de")
    )
    assert report.p_values["supervised"]["VQ-SemFace"]["en-de"] == cli["BLEU"]["p_value"]
    assert "(test BLEU, seed 1;" in report.markdown.read_text()


def test_missing_translations_read_as_not_available(workdir: Workdir, tmp_path: Path) -> None:
    """A work directory whose runs were deleted still gives its table, without p-values."""
    moved = Workdir(tmp_path, workdir.uri, workdir.test)
    report = build_report(_config(moved, (0, 1)), moved.uri, moved.path, moved.test)
    assert _rows(report.tables["supervised"])[1][-2:] == ["n/a", "n/a"]
    assert report.p_values["supervised"]["VQ-SemFace"] == {}
    assert "n/a: a run's test translations are missing" in report.markdown.read_text()


def test_diagnostics_table_reads_the_figures_of_each_language() -> None:
    from megasemface.pipeline.report import diagnostics_table

    vq = {
        "languages": [
            {
                "lang": "en",
                "encoder_codes": {"used": 322, "perplexity": 169.21},
                "extractor_codes": {"used": 56, "perplexity": 28.25},
                "code_agreement": 0.0062,
                "cosine": 0.0724,
                "nll": {"interface": 5.7151, "codes": 5.61, "encoder": 6.2149, "zeros": 6.3081},
            }
        ]
    }
    cl = {"languages": [{"lang": "de", "cosine": 0.5, "nll": None}]}
    table = diagnostics_table([("VQ-SemFace", 0, vq), ("CL-SemFace", 1, cl)]).splitlines()
    assert table[0].startswith("| system | seed | lang | encoder codes |")
    assert table[2] == (
        "| VQ-SemFace | 0 | en | 322 / 169.2 | 56 / 28.2 | 0.6% | 0.072 | 5.715 | 5.610 | 6.215 "
        "| 6.308 |"
    )
    assert table[3] == "| CL-SemFace | 1 | de | - | - | - | 0.500 | - | - | - | - |"


def _mlm(key: str, system: str, seed: int, en: float, de: float, step: int = 1000) -> object:
    from megasemface.pipeline.report import EncoderMlmRow

    languages = [
        {"lang": "en", "mlm": en, "targets": 100},
        {"lang": "de", "mlm": de, "targets": 300},
    ]
    figures = {"mlm": (en * 100 + de * 300) / 400, "step": step, "languages": languages}
    return EncoderMlmRow(key, system, seed, figures)


def test_encoder_mlm_table_gives_mean_std_over_seeds_and_the_gap_to_xlm() -> None:
    from megasemface.pipeline.report import encoder_mlm_table

    rows = [
        _mlm("xlm", "XLM", 0, 5.0, 6.0),
        _mlm("cl", "CL-SemFace", 0, 6.0, 7.0),
        _mlm("xlm", "XLM", 1, 5.5, 6.5),
        _mlm("cl", "CL-SemFace", 1, 6.5, 7.5),
        _mlm("vq", "VQ-SemFace", 0, 7.0, 8.0),
    ]
    table = encoder_mlm_table(rows, seeds=(0, 1)).splitlines()  # type: ignore[arg-type]
    assert table[0] == "| system | step | en | de | all | vs XLM |"
    assert _rows("\n".join(table)) == [
        ["XLM", "1000", "5.25 ± 0.35", "6.25 ± 0.35", "6.00 ± 0.35", "-"],
        ["CL-SemFace", "1000", "6.25 ± 0.35", "7.25 ± 0.35", "7.00 ± 0.35", "+1.00"],
        ["VQ-SemFace (seeds 0)", "1000", "7.00", "8.00", "7.75", "+1.75"],
    ]
    # Without XLM in the comparison there is no gap to show; one seed is a plain figure.
    alone = encoder_mlm_table([_mlm("cl", "CL-SemFace", 0, 6.0, 7.0, step=3)], seeds=(0,))  # type: ignore[list-item]
    assert alone.splitlines()[0] == "| system | step | en | de | all |"
    assert _rows(alone) == [["CL-SemFace", "3", "6.00", "7.00", "6.75"]]


def _pair_record(key: str, pair: str, seed: int, forward: float, backward: float) -> RunRecord:
    a, b = pair.split("-")
    record = _record(key, key.upper(), 0.0, 0.0, seed)
    return dataclasses.replace(
        record,
        run_id=f"{key}-{pair}-{seed}",
        name=seeded(f"supervised-{key}-{pair}", seed),
        tags={**record.tags, "pair": pair},
        metrics={
            f"test_bleu_{a}-{b}": forward,
            f"test_bleu_{b}-{a}": backward,
            "test_bleu": (forward + backward) / 2,
        },
    )


def test_several_pairs_make_one_row_per_system_from_each_pair_s_runs() -> None:
    """--languages: each direction's column is read from its pair's run; a system (or seed)
    without a run of every pair is left out rather than shown with a hole."""
    records = [
        _pair_record("vq", "en-de", 0, 10.0, 12.0),
        _pair_record("vq", "en-fr", 0, 20.0, 22.0),
        _pair_record("vq", "en-de", 1, 11.0, 13.0),  # seed 1 has no en-fr run
        _pair_record("xlm", "en-de", 0, 5.0, 6.0),  # no en-fr run at all
    ]
    (vq,) = collect_pairs(records, ["xlm", "vq"], [0, 1], "supervised", ["en-de", "en-fr"])
    directions = ["en-de", "de-en", "en-fr", "fr-en"]
    assert vq.seeds == (0,)
    assert vq.bleu(directions) == {
        "en-de": [10.0],
        "de-en": [12.0],
        "en-fr": [20.0],
        "fr-en": [22.0],
        "avg": [16.0],
    }
    assert vq.run_of(0, "fr-en").name == "supervised-vq-en-fr"
    assert sorted(r.name for r in vq.all_runs) == ["supervised-vq-en-de", "supervised-vq-en-fr"]
    table = paper_table([vq], directions)
    assert table.splitlines()[0] == "| system | en-de | de-en | en-fr | fr-en | avg | gain |"
    assert "| VQ | 10.00 | 12.00 | 20.00 | 22.00 | 16.00 | - |" in table


def test_grid_edges_names_the_choices_at_either_end_of_the_grid() -> None:
    def row(system: str, chosen: float, pair: str | None = None) -> GridChoice:
        scores = {(lr, 100): 1.0 for lr in (2e-3, 4e-3, 8e-3)}
        return GridChoice(system, "supervised", 1, pair, scores, (chosen, 100))

    assert grid_edges([row("XLM", 4e-3)]) is None
    line = grid_edges([row("XLM", 4e-3), row("Transformer", 8e-3), row("mBART", 2e-3, "en-fr")])
    assert line is not None
    assert (
        "Transformer (supervised, seed 1: highest); mBART (supervised, seed 1, en-fr: lowest)"
        in line
    )
    assert "XLM" not in line
    # A grid of one rate has no edge to step over.
    single = GridChoice("XLM", "supervised", 0, None, {(4e-3, 100): 1.0}, (4e-3, 100))
    assert grid_edges([single]) is None
