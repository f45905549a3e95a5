"""The README's main command timed step by step: ``python -m megasemface.demo`` from nothing.

Runs the demo pipeline in an empty work directory (the data, every training run, the test
translations and the report: everything ``make demo`` does after installing) and reads the
wall time of each of its steps from the ``timings.json`` the pipeline writes. The total
stands beside the README's limit for ``make demo`` (20 minutes, the install included, which
this does not time: about a minute and a half in a fresh clone). Each training step also
gives the time its launch spent outside the training loop (start-up and exit of the ranks,
from the loop's own clock in the run's metrics.jsonl), the part a faster step does not
shorten.

Run: ``python benchmarks/bench_demo.py [--budget demo] [--systems ...] [--json out.json]``;
``--budget smoke --systems transformer`` is a quick check of the benchmark itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megasemface.data.demo.demo_corpus import DEFAULT_LOCALE_DIR

ROOT = Path(__file__).resolve().parents[1]
LIMIT_SECONDS = 20 * 60
"""The README's limit for ``make demo``, the install included."""


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


def run(budget: str, locale_dir: Path, systems: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        workdir = Path(tmp) / "demo"
        log = Path(tmp) / "demo.log"
        cmd = [sys.executable, "-m", "megasemface.demo", "--workdir", str(workdir)]
        cmd += ["--budget", budget, "--locale-dir", str(locale_dir)]
        if systems:
            cmd += ["--systems", systems]
        started = time.perf_counter()
        with open(log, "w", encoding="utf-8") as out:
            code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - started
        if code != 0:
            tail = log.read_text(encoding="utf-8").splitlines()[-20:]
            raise SystemExit(f"the demo failed (exit {code}):\n" + "\n".join(tail))
        timings = json.loads((workdir / "timings.json").read_text(encoding="utf-8"))
        loops = {
            run.name: _loop_seconds(run / "metrics.jsonl")
            for run in sorted((workdir / "runs").iterdir())
            if (run / "metrics.jsonl").is_file()
        }
    return {
        "budget": budget,
        "systems": systems,
        "wall_seconds": wall,
        "timings": timings,
        "loop_seconds": loops,
    }


def _loop_seconds(metrics: Path) -> float:
    """Seconds from a run's loop start to its last step (``time`` of metrics.jsonl): its
    training loop, validation included."""
    times = [
        record["time"]
        for record in map(json.loads, metrics.read_text(encoding="utf-8").splitlines())
        if "time" in record
    ]
    return max(times, default=0.0)


def report(results: dict[str, Any]) -> str:
    timings = results["timings"]
    total = timings["total_seconds"]
    command = f"python -m megasemface.demo --budget {results['budget']}"
    if results.get("systems"):
        command += f" --systems {results['systems']}"
    lines = [
        f"`{command}` from an empty work "
        f"directory: **{_clock(total)}** (min:s; the process {_clock(results['wall_seconds'])}"
        f" with its start-up), beside the README's {_clock(LIMIT_SECONDS)} for `make demo` "
        "with its install.",
        "",
        "| step | kind | wall time |",
        "|---|---|---|",
    ]
    lines += [f"| {s['step']} | {s['kind']} | {_clock(s['seconds'])} |" for s in timings["steps"]]
    lines += ["", "| kind | wall time | share |", "|---|---|---|"]
    lines += [
        f"| {kind} | {_clock(seconds)} | {seconds / total:.0%} |"
        for kind, seconds in timings["by_kind"].items()
    ]
    training = [s for s in timings["steps"] if s["kind"] in ("pre-training", "fine-tuning")]
    loops = sum(results["loop_seconds"].values())
    spent = sum(s["seconds"] for s in training)
    lines += [
        "",
        f"The {len(training)} training steps took {_clock(spent)}, of which their training "
        f"loops (validation included) {_clock(loops)}: {_clock(spent - loops)} went to "
        "starting and ending the ranks, connecting models and writing checkpoints.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--budget", default="demo", help="the demo's budget (smoke: quick)")
    parser.add_argument("--systems", help="the demo's systems (default: the demo's own)")
    parser.add_argument("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    results = run(args.budget, args.locale_dir, args.systems)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
