"""The pipeline's comparison, read back from MLflow: the paper-shaped tables (BLEU per
direction and the average gain over the baseline row: the Transformer in Table 3, XLM in
Table 4), the run table with lineage, and the plots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megasemface.evaluation.lines import read_lines
from megasemface.evaluation.metrics import evaluate
from megasemface.pipeline.config import PipelineConfig
from megasemface.tracking.compare import (
    RunRecord,
    format_table,
    plot_bars,
    plot_curves,
    select_runs,
)

__all__ = ["Report", "baseline_of", "build_report", "copy_scores", "paper_table"]


@dataclasses.dataclass
class Report:
    tables: dict[str, str]
    """Per setting: the paper-shaped Markdown table."""
    bleu: dict[str, dict[str, dict[str, float]]]
    """setting -> system -> direction (and avg) -> test BLEU."""
    runs_table: str
    markdown: Path
    plots: list[Path]
    tracking_uri: str


def _newest_per_system(
    records: list[RunRecord], config: PipelineConfig, setting: str
) -> list[RunRecord]:
    """One run per system of this pipeline (the newest, when a system was run again)."""
    chosen: dict[str, RunRecord] = {}
    for record in records:  # oldest first
        if record.tags.get("setting") == setting and "test_bleu" in record.metrics:
            chosen[record.tags.get("system_key", "")] = record
    return [chosen[key] for key in config.systems if key in chosen]


def baseline_of(records: list[RunRecord], setting: str) -> RunRecord:
    """The row gains are measured from: the paper's Table 3 (supervised) measures from the
    Transformer without pre-training, Table 4 (unsupervised, where a model without
    pre-training learns next to nothing) from XLM. Otherwise the first row."""
    wanted = "xlm" if setting == "unsupervised" else "transformer"
    for record in records:
        if record.tags.get("system_key") == wanted:
            return record
    return records[0]


def paper_table(
    records: list[RunRecord], directions: list[str], baseline: RunRecord | None = None
) -> tuple[str, dict]:
    """Rows: systems; columns: test BLEU per direction, the average, and the average's gain
    over the ``baseline`` row (default: the first)."""

    def scores(record: RunRecord) -> dict[str, float]:
        bleu = {d: record.metrics.get(f"test_bleu_{d}", float("nan")) for d in directions}
        bleu["avg"] = sum(bleu.values()) / len(directions)
        return bleu

    baseline = baseline or records[0]
    reference = scores(baseline)["avg"]
    header = ["system", *directions, "avg", "gain"]
    rows, values = [], {}
    for record in records:
        bleu = scores(record)
        name = record.tags.get("system", record.name)
        values[name] = bleu
        gain = "-" if record is baseline else f"{bleu['avg'] - reference:+.2f}"
        rows.append([name, *[f"{bleu[d]:.2f}" for d in directions], f"{bleu['avg']:.2f}", gain])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines), values


def copy_scores(test_prefix: Path, directions: list[str]) -> dict[str, float]:
    """Test BLEU of copying each source sentence unchanged, per direction: the floor a system
    must beat, high on corpora with many untranslated strings (names, placeholders, commands,
    as in software catalogs)."""
    scores = {}
    for direction in directions:
        a, b = direction.split("-")
        source = read_lines(f"{test_prefix}.{a}")
        scores[direction] = evaluate(source, read_lines(f"{test_prefix}.{b}")).bleu.score
    return scores


def build_report(
    config: PipelineConfig, tracking_uri: str, workdir: Path, test_prefix: Path | None = None
) -> Report:
    """``test_prefix``: the test set (``<prefix>.<lang>``), for the copy-the-source floor."""
    src, tgt = config.langs
    directions = [f"{src}-{tgt}", f"{tgt}-{src}"]
    floor = ""
    if test_prefix is not None:
        copied = copy_scores(test_prefix, directions)
        floor = "copying the source unchanged scores BLEU " + ", ".join(
            f"{d} {v:.2f}" for d, v in copied.items()
        )
    records = select_runs(
        tracking_uri, experiments=[config.experiment_name], tags={"stage": "finetune"}
    )
    tables, bleu, baselines, chosen = {}, {}, {}, []
    for setting in config.settings:
        runs = _newest_per_system(records, config, setting)
        if not runs:
            continue
        baseline = baseline_of(runs, setting)
        tables[setting], bleu[setting] = paper_table(runs, directions, baseline)
        baselines[setting] = baseline.tags.get("system", baseline.name)
        chosen += runs
    runs_table = format_table(
        chosen,
        [
            "name",
            "tags.system",
            "tags.setting",
            "metrics.test_bleu",
            "metrics.test_chrf",
            "metrics.best_valid_bleu",
            "metrics.loss",
            "duration",
            "lineage",
        ],
        "markdown",
    )
    plots = [
        plot_bars(
            chosen,
            workdir / "test-bleu.png",
            metric="test_bleu",
            label_tag="system",
            group_tag="setting",
            title=f"test BLEU, {config.pair} (mean of both directions)",
        ),
        plot_curves(chosen, workdir / "finetune-loss.png", metric="loss", title="fine-tuning loss"),
    ]
    parts = [f"# megasemface comparison, {config.pair}\n"]
    for setting, table in tables.items():
        gain = f"gain: average over {baselines[setting]}"
        parts += [f"## {setting} (test BLEU; {gain})\n", table, ""]
    if floor:
        parts += [f"For reference, {floor}.\n"]
    parts += ["## runs\n", runs_table, "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    markdown = workdir / "results.md"
    markdown.write_text("\n".join(parts), encoding="utf-8")
    for setting, table in tables.items():
        print(
            f"\n{setting} fine-tuning, test BLEU ({config.pair}, sacreBLEU; gain over "
            f"{baselines[setting]}):\n{table}"
        )
    if floor:
        print(f"(for reference, {floor})")
    print(f"\nruns:\n{runs_table}")
    print(f"\nreport: {markdown}\nplots: {', '.join(str(p) for p in plots)}")
    print(f"MLflow store: {tracking_uri}")
    print(f"open the MLflow UI with: mlflow ui --backend-store-uri {tracking_uri}")
    return Report(tables, bleu, runs_table, markdown, plots, tracking_uri)
