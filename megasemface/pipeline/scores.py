"""The numbers behind the pipeline's comparison: each system's test BLEU over its seeds, and
sacreBLEU's paired bootstrap p-value of each system against the baseline row.

How seeds enter the significance test: per direction, a system's hypotheses of all seeds are
concatenated seed by seed (in seed order), the baseline's likewise, against the references
repeated once per seed. Each test item, resampled by the bootstrap, then pairs seed s of the
system with seed s of the baseline on the same sentence, and there is one p-value per system
and direction. With one seed this is exactly sacreBLEU's test of the two hypothesis files.
The bootstrap resamples test sentences: the p-value says whether the difference, summed over
the seeds run, could come from the choice of test sentences. How much a system moves from seed
to seed is what the standard deviation shows; with few seeds, read both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from megasemface.data.text.lines import read_lines
from megasemface.evaluation.significance import PairedResult, paired_bootstrap
from megasemface.pipeline.launcher import LaunchError
from megasemface.pipeline.settings import SETTINGS
from megasemface.tracking.compare import RunRecord

__all__ = [
    "SystemScores",
    "baseline_key",
    "best_valid_bleu",
    "collect_pairs",
    "collect_systems",
    "hypotheses_file",
    "mean_std",
    "paired_p_values",
    "run_seed",
]


@dataclasses.dataclass(frozen=True)
class SystemScores:
    """One system's fine-tuning runs in one setting, one per seed."""

    key: str
    """The system's key (``vq``), its runs' ``system_key`` tag."""
    name: str
    """The table's row label (``VQ-SemFace``), its runs' ``system`` tag."""
    runs: dict[int, RunRecord]
    """seed -> the run, in ascending seed order."""
    direction_runs: dict[str, dict[int, RunRecord]] = dataclasses.field(default_factory=dict)
    """A pipeline over several pairs: direction -> seed -> the run of that direction's pair
    (``runs``: the first pair's); empty: every direction is ``runs``'."""

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(self.runs)

    def run_of(self, seed: int, direction: str) -> RunRecord:
        """The run whose test translations are of ``direction``."""
        return self.direction_runs.get(direction, self.runs)[seed]

    @property
    def all_runs(self) -> list[RunRecord]:
        """Every run of the system: one per seed, of each pair."""
        chosen = {id(r): r for r in self.runs.values()}
        for runs in self.direction_runs.values():
            chosen.update({id(r): r for r in runs.values()})
        return list(chosen.values())

    def bleu(self, directions: Sequence[str]) -> dict[str, list[float]]:
        """Test BLEU per direction and their average ("avg"), one value per seed."""
        columns: dict[str, list[float]] = {d: [] for d in [*directions, "avg"]}
        for seed in self.runs:
            values = [
                self.run_of(seed, d).metrics.get(f"test_bleu_{d}", math.nan) for d in directions
            ]
            for direction, value in zip(directions, values, strict=True):
                columns[direction].append(value)
            columns["avg"].append(sum(values) / len(values))
        return columns


def run_seed(record: RunRecord) -> int | None:
    """A run's seed: its ``seed`` tag, else the ``train.seed`` its config logged (runs made
    before the pipeline tagged seeds, which a workdir may still reuse)."""
    value = record.tags.get("seed") or record.params.get("train.seed")
    return int(value) if value is not None and value.isdecimal() else None


def collect_systems(
    records: Sequence[RunRecord], systems: Sequence[str], seeds: Sequence[int], setting: str
) -> list[SystemScores]:
    """Per system of ``systems`` (in that order), its scored fine-tuning run of each seed of
    ``seeds`` in ``setting``: the newest, when one was run again. Systems without any such
    run are left out."""
    chosen: dict[str, dict[int, RunRecord]] = {}
    names: dict[str, str] = {}
    for record in records:  # oldest first: a newer run of a seed replaces an older one
        key, seed = record.tags.get("system_key", ""), run_seed(record)
        if record.tags.get("setting") != setting or "test_bleu" not in record.metrics:
            continue
        if key in systems and seed in seeds:
            chosen.setdefault(key, {})[seed] = record
            names[key] = record.tags.get("system", record.name)
    return [
        SystemScores(key, names[key], {s: chosen[key][s] for s in sorted(chosen[key])})
        for key in systems
        if key in chosen
    ]


def collect_pairs(
    records: Sequence[RunRecord],
    systems: Sequence[str],
    seeds: Sequence[int],
    setting: str,
    pairs: Sequence[str],
) -> list[SystemScores]:
    """:func:`collect_systems` over several pairs (runs tagged ``pair``): per system, the
    seeds that have a scored run of every pair, each direction read from its pair's run.
    Systems without such a seed are left out."""
    by_pair = {
        pair: {
            s.key: s
            for s in collect_systems(
                [r for r in records if r.tags.get("pair") == pair], systems, seeds, setting
            )
        }
        for pair in pairs
    }
    out = []
    for key in systems:
        found = [by_pair[pair].get(key) for pair in pairs]
        if any(s is None for s in found):
            continue
        complete = [seed for seed in seeds if all(seed in s.runs for s in found if s)]
        if not complete:
            continue
        direction_runs = {}
        for pair, scores in zip(pairs, found, strict=True):
            a, b = pair.split("-")
            assert scores is not None
            for direction in (f"{a}-{b}", f"{b}-{a}"):
                direction_runs[direction] = {seed: scores.runs[seed] for seed in complete}
        first = found[0]
        assert first is not None
        runs = {seed: first.runs[seed] for seed in complete}
        out.append(SystemScores(key, first.name, runs, direction_runs))
    return out


def baseline_key(keys: Sequence[str], setting: str) -> str:
    """The row gains are measured from: the paper's Table 3 (supervised) measures from the
    Transformer without pre-training, Table 4 (unsupervised, where a model without
    pre-training learns next to nothing) from XLM. Otherwise the first row."""
    wanted = SETTINGS[setting].baseline
    return wanted if wanted in keys else keys[0]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator: the seeds are a sample
    of the seeds one could run); the deviation of a single value is NaN, not 0."""
    std = statistics.stdev(values) if len(values) > 1 else math.nan
    return statistics.fmean(values), std


def hypotheses_file(workdir: Path, record: RunRecord, direction: str) -> Path:
    """Where the pipeline wrote a run's test translations: ``<workdir>/runs/<run name>/
    test.<a>-<b>.<b>`` (a pipeline run is named after its directory)."""
    target = direction.split("-")[1]
    return workdir / "runs" / record.name / f"test.{direction}.{target}"


def _concatenated(
    scores: SystemScores, seeds: Sequence[int], workdir: Path, direction: str, lines: int
) -> list[str] | None:
    """The hypotheses of ``seeds``, seed after seed; None if one file is missing or has not
    ``lines`` lines (a moved or partly deleted work directory, another test set)."""
    out: list[str] = []
    for seed in seeds:
        path = hypotheses_file(workdir, scores.run_of(seed, direction), direction)
        hypotheses = read_lines(path) if path.is_file() else []
        if len(hypotheses) != lines:
            return None
        out += hypotheses
    return out


def paired_p_values(
    system: SystemScores,
    baseline: SystemScores,
    directions: Sequence[str],
    workdir: Path,
    test_prefix: Path,
) -> dict[str, PairedResult | None]:
    """Per direction, sacreBLEU's paired bootstrap of ``system`` against ``baseline`` over
    the seeds both have (see the module's docstring); None where hypotheses are missing."""
    seeds = [s for s in system.seeds if s in baseline.runs]
    results: dict[str, PairedResult | None] = {}
    for direction in directions:
        references = read_lines(f"{test_prefix}.{direction.split('-')[1]}")
        ours = _concatenated(system, seeds, workdir, direction, len(references))
        theirs = _concatenated(baseline, seeds, workdir, direction, len(references))
        if not seeds or not references or ours is None or theirs is None:
            results[direction] = None
        else:
            results[direction] = paired_bootstrap(theirs, ours, references * len(seeds))
    return results


def best_valid_bleu(run_dir: Path) -> float:
    """The validation BLEU of a fine-tuning run's best model (``<run>/best``).

    Raises:
        LaunchError: the run kept no best model (it never validated).
    """
    record = run_dir / "best" / "config.json"
    try:
        return float(json.loads(record.read_text(encoding="utf-8"))["meta"]["valid_bleu"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LaunchError(
            f"{record}: no best model with a validation BLEU ({exc}); the grid chooses on "
            "validation: give --valid-interval at most --finetune-steps"
        ) from exc
