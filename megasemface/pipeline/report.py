"""The pipeline's comparison, read back from MLflow: the paper-shaped tables (test BLEU per
direction and their average, as mean ± std over seeds; the average's gain over the baseline
row, the Transformer in Table 3 and XLM in Table 4; sacreBLEU's paired bootstrap p-value of
each system against that row), the run table with lineage, and the plots. The numbers come
from :mod:`megasemface.pipeline.scores`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from megasemface.data.text.lines import read_lines
from megasemface.evaluation.metrics import evaluate
from megasemface.evaluation.significance import BOOTSTRAP_SAMPLES, PairedResult
from megasemface.pipeline.config import PipelineConfig
from megasemface.pipeline.scores import (
    SystemScores,
    baseline_key,
    collect_pairs,
    collect_systems,
    mean_std,
    paired_p_values,
)
from megasemface.tracking.compare import (
    RunRecord,
    format_table,
    plot_bars,
    plot_curves,
    select_runs,
)
from megasemface.tracking.mlflow_names import redact_uri

__all__ = [
    "EncoderMlmRow",
    "GridChoice",
    "Report",
    "baseline_of",
    "build_report",
    "copy_scores",
    "describe_seeds",
    "diagnostics_table",
    "encoder_mlm_table",
    "grid_edges",
    "grid_table",
    "paper_table",
    "reading_table",
]

SIGNIFICANCE_LEVEL = 0.05
"""p-values below it get a ``*`` in the tables, as sacreBLEU's own paired test output."""

MLM_BASELINE = "xlm"
"""The system whose encoder MLM the others' is compared with: XLM's encoder is the MLM
encoder without an interface that SemFace's encoders are meant to stay close to."""

PValues = dict[str, dict[str, PairedResult | None]]
"""system name -> direction -> sacreBLEU's paired test against the baseline (None: no files)."""


@dataclasses.dataclass
class Report:
    tables: dict[str, str]
    """Per setting: the paper-shaped Markdown table."""
    bleu: dict[str, dict[str, dict[str, float]]]
    """setting -> system -> direction (and avg) -> test BLEU, the mean over seeds."""
    std: dict[str, dict[str, dict[str, float]]]
    """As ``bleu``: the sample standard deviation over seeds (NaN with one seed)."""
    p_values: dict[str, dict[str, dict[str, float]]]
    """setting -> system -> direction -> sacreBLEU's paired bootstrap p-value against the
    setting's baseline row (absent: the baseline itself, or hypotheses missing)."""
    seeds: tuple[int, ...]
    runs_table: str
    markdown: Path
    plots: list[Path]
    tracking_uri: str


def baseline_of(records: list[RunRecord], setting: str) -> RunRecord:
    """The run of the baseline row (see :func:`~megasemface.pipeline.scores.baseline_key`)."""
    keys = [record.tags.get("system_key", "") for record in records]
    return records[keys.index(baseline_key(keys, setting))]


def describe_seeds(seeds: Sequence[int]) -> str:
    """``seed 0``, or ``mean ± std over 3 seeds: 0, 1, 2``."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"mean ± std over {len(seeds)} seeds: {', '.join(map(str, seeds))}"


def _cell(values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {std:.2f}"


def _p_cell(result: PairedResult | None) -> str:
    if result is None:
        return "n/a"
    star = "*" if result.p_value < SIGNIFICANCE_LEVEL else ""
    return f"{result.p_value:.4f}{star}"


def paper_table(
    systems: Sequence[SystemScores],
    directions: list[str],
    baseline: SystemScores | None = None,
    p_values: PValues | None = None,
    seeds: Sequence[int] | None = None,
) -> str:
    """Rows: systems; columns: test BLEU per direction and the average (the plain score with
    one seed, ``mean ± std`` with several), the average's gain over the ``baseline`` row
    (default: the first) as a difference of means, and with ``p_values`` a p-value per
    direction. A system whose seeds are not ``seeds`` says which it has."""
    baseline = baseline or systems[0]
    reference = mean_std(baseline.bleu(directions)["avg"])[0]
    header = ["system", *directions, "avg", "gain"]
    if p_values is not None:
        header += [f"p {d}" for d in directions]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system in systems:
        bleu = system.bleu(directions)
        name = system.name
        if seeds is not None and system.seeds != tuple(seeds):
            name += f" (seeds {', '.join(map(str, system.seeds))})"
        gain = mean_std(bleu["avg"])[0] - reference
        row = [name, *[_cell(bleu[c]) for c in [*directions, "avg"]]]
        row.append("-" if system is baseline else f"{gain:+.2f}")
        if p_values is not None:
            tests = p_values.get(system.name, {})
            row += ["-" if system is baseline else _p_cell(tests.get(d)) for d in directions]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _p_note(baseline: str, seeds: Sequence[int], p_values: PValues) -> str:
    """How the p-values were computed, under the table (with sacreBLEU's signature)."""
    signatures = {r.signature for tests in p_values.values() for r in tests.values() if r}
    pairing = (
        f"the hypotheses of seeds {', '.join(map(str, seeds))} concatenated, each seed paired "
        f"with the same seed of {baseline}"
        if len(seeds) > 1
        else f"the hypotheses of seed {seeds[0]} against {baseline}'s"
    )
    note = (
        f"p: sacreBLEU's paired bootstrap resampling against {baseline}, per direction "
        f"({BOOTSTRAP_SAMPLES} resamples; * p < {SIGNIFICANCE_LEVEL}); {pairing}"
    )
    if any(r is None for tests in p_values.values() for r in tests.values()):
        note += "; n/a: a run's test translations are missing"
    return note + "".join(f"; signature {s}" for s in sorted(signatures)) + "."


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


@dataclasses.dataclass
class _Section:
    """One setting's part of the report."""

    table: str
    note: str
    """How the p-values were computed ("" without them)."""
    baseline: str
    bleu: dict[str, dict[str, float]]
    std: dict[str, dict[str, float]]
    p_values: dict[str, dict[str, float]]
    runs: list[RunRecord]


def _compare(
    records: list[RunRecord],
    config: PipelineConfig,
    setting: str,
    directions: list[str],
    workdir: Path,
    tests_of: dict[str, Path],
) -> _Section | None:
    """The table, statistics and p-values of one setting; None when it has no scored run.
    ``tests_of``: each pair's test set (none: no p-values)."""
    seeds = config.run_seeds
    if config.multilingual:
        systems = collect_pairs(records, config.systems, seeds, setting, config.pairs)
    else:
        systems = collect_systems(records, config.systems, seeds, setting)
    if not systems:
        return None
    key = baseline_key([s.key for s in systems], setting)
    baseline = next(s for s in systems if s.key == key)
    tests: PValues | None = None
    if tests_of:
        tests = {}
        for s in systems:
            if s is baseline:
                continue
            tests[s.name] = {}
            for pair, prefix in tests_of.items():
                a, b = pair.split("-")
                pair_directions = [f"{a}-{b}", f"{b}-{a}"]
                tests[s.name] |= paired_p_values(s, baseline, pair_directions, workdir, prefix)
    stats = {s.name: {c: mean_std(v) for c, v in s.bleu(directions).items()} for s in systems}
    return _Section(
        table=paper_table(systems, directions, baseline, tests, seeds),
        note=_p_note(baseline.name, seeds, tests) if tests is not None else "",
        baseline=baseline.name,
        bleu={name: {c: mean for c, (mean, _) in cols.items()} for name, cols in stats.items()},
        std={name: {c: std for c, (_, std) in cols.items()} for name, cols in stats.items()},
        p_values={
            name: {d: r.p_value for d, r in results.items() if r is not None}
            for name, results in (tests or {}).items()
        },
        runs=[record for system in systems for record in system.all_runs],
    )


class GridChoice(NamedTuple):
    """One fine-tuning's grid: each setting's best validation BLEU and the one chosen."""

    system: str
    setting: str
    seed: int
    pair: str | None
    scores: dict[tuple[float, int], float]
    """(peak learning rate, warm-up steps) -> the run's best validation BLEU."""
    chosen: tuple[float, int]


def grid_table(rows: Sequence[GridChoice]) -> str:
    """Markdown: per system, setting, seed (and pair), the best validation BLEU of every
    fine-tuning setting tried, the chosen one in bold."""
    choices = list(dict.fromkeys(choice for row in rows for choice in row.scores))
    pairs = any(row.pair for row in rows)
    header = ["system", "setting", "seed", *(["pair"] if pairs else [])]
    header += [f"lr {lr:g}, warm-up {w}" for lr, w in choices]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.system, row.setting, str(row.seed), *([row.pair or "-"] if pairs else [])]
        for choice in choices:
            score = row.scores.get(choice)
            text = "-" if score is None else f"{score:.2f}"
            cells.append(f"**{text}**" if choice == row.chosen else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_edges(rows: Sequence[GridChoice]) -> str | None:
    """A line naming every grid whose chosen learning rate is its lowest or highest, where
    the best setting may lie outside what was tried; None when every choice is inside."""
    edges = []
    for row in rows:
        rates = sorted({lr for lr, _ in row.scores})
        if len(rates) < 2 or row.chosen[0] not in (rates[0], rates[-1]):
            continue
        side = "highest" if row.chosen[0] == rates[-1] else "lowest"
        pair = f", {row.pair}" if row.pair else ""
        edges.append(f"{row.system} ({row.setting}, seed {row.seed}{pair}: {side})")
    if not edges:
        return None
    return (
        f"Chosen at the grid's edge, where a better rate may lie beyond it: {'; '.join(edges)}. "
        "A wider --finetune-grid tells."
    )


def diagnostics_table(rows: Sequence[tuple[str, int, dict[str, Any]]]) -> str:
    """Markdown: per system, seed and language, the interface diagnostics (as
    ``Diagnostics.to_dict()`` gives them) that say whether the interface connects: codes the
    encoder and the decoder stage's extractor pick (used / histogram perplexity) and the
    share of tokens on which they agree, cosine of the encoder's output with its interface
    vector, and the pre-trained decoder's NLL per token with its interface's memory, the
    encoder's own codes, the encoder's output and zeros."""

    def codes(figures: dict[str, Any] | None) -> str:
        return f"{figures['used']} / {figures['perplexity']:.1f}" if figures else "-"

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    header = ["system", "seed", "lang", "encoder codes", "extractor codes", "agree", "cosine"]
    header += ["NLL interface", "NLL codes", "NLL encoder", "NLL zeros"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, seed, data in rows:
        for lang in data["languages"]:
            nll = lang.get("nll") or {}
            cells = [system, str(seed), lang["lang"], codes(lang.get("encoder_codes"))]
            agree = lang.get("code_agreement")
            cells += [codes(lang.get("extractor_codes")), "-" if agree is None else f"{agree:.1%}"]
            cells += [number(lang.get("cosine"))]
            cells += [number(nll.get(k)) for k in ("interface", "codes", "encoder", "zeros")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


READING_NOTE = (
    "The pre-trained decoder's NLL per token of each validation sentence with the connected "
    "encoder's output for its translation, for an unrelated sentence of the same language "
    "and the nearest length, and for zeros; and the connected model's zero-shot greedy "
    "BLEU. A language-independent interface reads the translation clearly better than both. "
    "Recentred: the translation's encoding with its language's mean output swapped for the "
    "target language's; a gain there that the translation lacks is a shift between the "
    "languages' outputs."
)


def reading_table(rows: Sequence[tuple[str, int, dict[str, Any]]]) -> str:
    """Markdown: per system, seed and direction, whether the connected model reads a
    translation (``Diagnostics.to_dict()``'s ``reading``); empty when none was measured."""
    header = ["system", "seed", "direction", "NLL translation", "NLL unrelated", "NLL zeros"]
    header += ["vs zeros", "vs unrelated", "recentred vs zeros", "zero-shot BLEU"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, seed, data in rows:
        for d in data.get("reading") or []:
            nll = d["nll"]
            cells = [system, str(seed), d["direction"]]
            cells += [f"{nll[m]:.3f}" for m in ("translation", "unrelated", "zeros")]
            cells += [f"{d['gain_over_zeros']:+.3f}", f"{d['gain_over_unrelated']:+.3f}"]
            # Runs diagnosed before the recentred memory was measured have no such figure.
            recentred = d.get("recentred_gain_over_zeros")
            cells.append("-" if recentred is None else f"{recentred:+.3f}")
            cells.append("-" if d.get("bleu") is None else f"{d['bleu']:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


class EncoderMlmRow(NamedTuple):
    """One pre-training's encoder MLM on validation text."""

    key: str
    """The system's key (``xlm``, ``cl``, ...)."""
    system: str
    seed: int
    figures: dict[str, Any]
    """As ``EncoderMlm.to_dict()`` gives them (``<run>/valid-mlm.json``)."""


def encoder_mlm_table(rows: Sequence[EncoderMlmRow], seeds: Sequence[int] | None = None) -> str:
    """Markdown: per system, the encoder MLM on validation text at its pre-training's last
    step, in nats per predicted token, per language and over all (``mean ± std`` over its
    seeds with several), and with XLM among the rows the difference of the means over all
    from XLM's. A system whose seeds are not ``seeds`` says which it has."""
    by_system: dict[str, list[EncoderMlmRow]] = {}
    for row in rows:
        by_system.setdefault(row.system, []).append(row)
    langs = list(dict.fromkeys(x["lang"] for row in rows for x in row.figures["languages"]))
    baseline = [row.figures["mlm"] for row in rows if row.key == MLM_BASELINE]
    header = ["system", "step", *langs, "all", *(["vs XLM"] if baseline else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in by_system.items():
        run_seeds = tuple(row.seed for row in runs)
        if seeds is not None and run_seeds != tuple(seeds):
            name += f" (seeds {', '.join(map(str, run_seeds))})"
        steps = dict.fromkeys(str(row.figures["step"]) for row in runs)
        cells = [name, ", ".join(steps)]
        for lang in langs:
            values = [
                x["mlm"] for row in runs for x in row.figures["languages"] if x["lang"] == lang
            ]
            cells.append(_cell(values) if values else "-")
        cells.append(_cell([row.figures["mlm"] for row in runs]))
        if baseline:
            gap = mean_std([row.figures["mlm"] for row in runs])[0] - mean_std(baseline)[0]
            cells.append("-" if runs[0].key == MLM_BASELINE else f"{gap:+.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_report(
    config: PipelineConfig,
    tracking_uri: str,
    workdir: Path,
    test_prefix: Path | None = None,
    diagnostics: Sequence[tuple[str, int, dict[str, Any]]] = (),
    pair_tests: dict[str, Path] | None = None,
    grid: Sequence[GridChoice] = (),
    encoder_mlms: Sequence[EncoderMlmRow] = (),
) -> Report:
    """``test_prefix``: the test set (``<prefix>.<lang>``), for the copy-the-source floor and
    the paired tests (without it, the tables have no p-values). ``diagnostics``: (system,
    seed, figures) of the SemFace pre-trainings, a table of their own; ``encoder_mlms``, of
    the pre-trainings with an encoder MLM, another. A pipeline over
    several pairs: ``pair_tests`` gives each pair's test set instead, and the one table has
    both directions of every pair."""
    tests_of = dict(pair_tests or {})
    if not config.multilingual and test_prefix is not None:
        tests_of = {config.pair: test_prefix}
    directions = []
    for pair in config.pairs:
        src, tgt = pair.split("-")
        directions += [f"{src}-{tgt}", f"{tgt}-{src}"]
    seeds = config.run_seeds
    floor = ""
    if tests_of:
        copied = {}
        for pair, prefix in tests_of.items():
            src, tgt = pair.split("-")
            copied |= copy_scores(prefix, [f"{src}-{tgt}", f"{tgt}-{src}"])
        floor = "copying the source unchanged scores BLEU " + ", ".join(
            f"{d} {v:.2f}" for d, v in copied.items()
        )
    records = select_runs(
        tracking_uri, experiments=[config.experiment_name], tags={"stage": "finetune"}
    )
    sections = {}
    for setting in config.settings:
        section = _compare(records, config, setting, directions, workdir, tests_of)
        if section is not None:
            sections[setting] = section
    chosen = [record for section in sections.values() for record in section.runs]
    runs_table = format_table(
        chosen,
        [
            "name",
            "tags.system",
            *(["tags.pair"] if config.multilingual else []),
            "tags.setting",
            "tags.seed",
            "metrics.test_bleu",
            "metrics.test_chrf",
            "metrics.best_valid_bleu",
            "metrics.loss",
            "duration",
            "lineage",
        ],
        "markdown",
    )
    seeds_text = describe_seeds(seeds)
    spread = "; bars: mean, lines: range, dots: seeds" if len(seeds) > 1 else ""
    plots = [
        plot_bars(
            chosen,
            workdir / "test-bleu.png",
            metric="test_bleu",
            label_tag="system",
            # Several pairs: a group per pair (the setting is supervised).
            group_tag="pair" if config.multilingual else "setting",
            title=f"test BLEU, {config.name} (mean of both directions; {seeds_text}{spread})",
        ),
        plot_curves(chosen, workdir / "finetune-loss.png", metric="loss", title="fine-tuning loss"),
    ]
    parts = [f"# megasemface comparison, {config.name}\n"]
    if config.multilingual:
        parts += [
            f"One pre-training per system over {', '.join(config.languages)}; each pair "
            "fine-tuned from it and tested in both directions.\n"
        ]
    for setting, section in sections.items():
        gain = f"gain: average over {section.baseline}"
        parts += [f"## {setting} (test BLEU, {seeds_text}; {gain})\n", section.table, ""]
        if section.note:
            parts += [section.note, ""]
    if floor:
        parts += [f"For reference, {floor}.\n"]
    if grid:
        heading = "## fine-tuning settings chosen on validation (best validation BLEU)\n"
        parts += [heading, grid_table(grid), ""]
        edges = grid_edges(grid)
        if edges:
            parts += [edges, ""]
    if diagnostics:
        heading = "## interface diagnostics (validation text; tools/diagnose_interface.py)\n"
        parts += [heading, diagnostics_table(diagnostics), ""]
    reading = reading_table(diagnostics)
    if reading:
        heading = (
            "## does the connected, pre-trained model read a translation? (validation pairs, "
            "before fine-tuning)\n"
        )
        parts += [heading, READING_NOTE, "", reading, ""]
    if encoder_mlms:
        heading = (
            f"## encoder MLM on validation text (nats per predicted token at the last "
            f"pre-training step, {seeds_text}; tools/valid_mlm.py)\n"
        )
        parts += [heading, encoder_mlm_table(encoder_mlms, seeds), ""]
    parts += ["## runs\n", runs_table, "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    markdown = workdir / "results.md"
    markdown.write_text("\n".join(parts), encoding="utf-8")
    for setting, section in sections.items():
        print(
            f"\n{setting} fine-tuning, test BLEU ({config.name}, sacreBLEU, {seeds_text}; gain "
            f"over {section.baseline}):\n{section.table}"
        )
        if section.note:
            print(section.note)
    if floor:
        print(f"(for reference, {floor})")
    print(f"\nruns:\n{runs_table}")
    print(f"\nreport: {markdown}\nplots: {', '.join(str(p) for p in plots)}")
    shown = redact_uri(tracking_uri)
    print(f"MLflow store: {shown}")
    if tracking_uri.startswith(("http://", "https://")):
        print(f"open the MLflow UI at {shown}")
    else:
        print(f"open the MLflow UI with: mlflow ui --backend-store-uri {shown}")
    return Report(
        {setting: section.table for setting, section in sections.items()},
        {setting: section.bleu for setting, section in sections.items()},
        {setting: section.std for setting, section in sections.items()},
        {setting: section.p_values for setting, section in sections.items()},
        seeds,
        runs_table,
        markdown,
        plots,
        tracking_uri,
    )
