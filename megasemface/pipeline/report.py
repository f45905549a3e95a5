"""The pipeline's comparison, read back from MLflow: the paper-shaped tables (BLEU per
direction and the average gain over the first row, as in Tables 3 and 4), the run table with
lineage, and the plots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megasemface.pipeline.config import PipelineConfig
from megasemface.tracking.compare import (
    RunRecord,
    format_table,
    plot_bars,
    plot_curves,
    select_runs,
)

__all__ = ["Report", "build_report", "paper_table"]


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


def paper_table(records: list[RunRecord], directions: list[str]) -> tuple[str, dict]:
    """Rows: systems; columns: test BLEU per direction, the average, and the average's gain
    over the first row (the paper's baseline row)."""
    header = ["system", *directions, "avg", "gain"]
    rows, values = [], {}
    baseline = None
    for record in records:
        bleu = {d: record.metrics.get(f"test_bleu_{d}", float("nan")) for d in directions}
        bleu["avg"] = sum(bleu.values()) / len(directions)
        baseline = bleu["avg"] if baseline is None else baseline
        name = record.tags.get("system", record.name)
        values[name] = bleu
        gain = "-" if record is records[0] else f"{bleu['avg'] - baseline:+.2f}"
        rows.append([name, *[f"{bleu[d]:.2f}" for d in directions], f"{bleu['avg']:.2f}", gain])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines), values


def build_report(config: PipelineConfig, tracking_uri: str, workdir: Path) -> Report:
    src, tgt = config.langs
    directions = [f"{src}-{tgt}", f"{tgt}-{src}"]
    records = select_runs(
        tracking_uri, experiments=[config.experiment_name], tags={"stage": "finetune"}
    )
    tables, bleu, chosen = {}, {}, []
    for setting in config.settings:
        runs = _newest_per_system(records, config, setting)
        if not runs:
            continue
        tables[setting], bleu[setting] = paper_table(runs, directions)
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
        parts += [f"## {setting} (test BLEU; gain: average over the first row)\n", table, ""]
    parts += ["## runs\n", runs_table, "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    markdown = workdir / "results.md"
    markdown.write_text("\n".join(parts), encoding="utf-8")
    for setting, table in tables.items():
        print(f"\n{setting} fine-tuning, test BLEU ({config.pair}, sacreBLEU):\n{table}")
    print(f"\nruns:\n{runs_table}")
    print(f"\nreport: {markdown}\nplots: {', '.join(str(p) for p in plots)}")
    print(f"MLflow store: {tracking_uri}")
    print(f"open the MLflow UI with: mlflow ui --backend-store-uri {tracking_uri}")
    return Report(tables, bleu, runs_table, markdown, plots, tracking_uri)
