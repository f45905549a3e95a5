"""Every benchmark in benchmarks/ runs, at its smallest size, as a user runs it: a refactor
that breaks one fails here, not at the next measurement. The figures are not checked (they
are the benchmarks' job); the exit status and the JSON figures file are."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

SMALLEST = {
    "bench_data.py": "--copies 1",
    "bench_demo.py": "--budget smoke --systems transformer",
    "bench_embeddings.py": "--vocab 2000 --dim 16 --demo-epochs 1 --tokens 100000",
    "bench_export.py": "--model-dir {init} --input {text} --sentences 4 --rounds 1",
    "bench_gpu.py": "--cpu --preset tiny --sentences 4 --length 8 --repeats 1 --no-compile",
    "bench_model.py": "--presets tiny --repeats 1 --no-compile",
    "bench_peer.py": "--shapes tiny --repeats 1 --batch-scale 0.125",
    "bench_revision.py": "--rounds 1 --steps 2",
    "bench_scale.py": "--smoke --workdir {out}/work --out {out}/report.md",
    "bench_train.py": "--steps 8",
    "bench_translate.py": "--presets tiny --repeats 1",
    "bench_vq.py": "--tokens 16 --codes 256 --d-model 32 --hidden 32 --chunk 16 --repeats 1",
}
"""Each benchmark's smallest command line; ``{...}`` are the ``launch_data`` fixture's paths
and ``{out}`` the test's own directory."""

NEEDS: dict[str, tuple[str, str]] = {
    "bench_peer.py": ("transformers", "the bench extra: pip install -e '.[bench]'"),
    "bench_export.py": ("ctranslate2", "the export extra: pip install -e '.[export]'"),
}
"""Benchmarks that need an optional package: the module, and where it comes from."""


def test_every_benchmark_has_its_smallest_run() -> None:
    assert {path.name for path in BENCHMARKS.glob("bench_*.py")} == set(SMALLEST)


def _has_revision(script: Path) -> str | None:
    """bench_revision.py's earlier revision, or None where the clone lacks it (shallow)."""
    text = script.read_text(encoding="utf-8")
    revision = text.split('BEFORE_SPEED_WORK = "', 1)[1].split('"', 1)[0]
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{revision}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    return revision if found.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.launcher  # each starts the benchmark's own processes
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_the_benchmark_runs_at_its_smallest_size(
    script: str, launch_data: dict, tmp_path: Path
) -> None:
    module, where = NEEDS.get(script, ("", ""))
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{script} needs {module}, from {where}")
    if script == "bench_revision.py" and _has_revision(BENCHMARKS / script) is None:
        pytest.skip("bench_revision.py needs the repository's history (a shallow clone lacks it)")
    text = tmp_path / "test.en"
    text.write_text("Open the file.\nSave the document.\nClose it.\nPrint.\n", encoding="utf-8")
    paths = {"init": str(launch_data["init"]), "text": str(text), "out": str(tmp_path)}
    figures = tmp_path / "figures.json"
    argv = SMALLEST[script].format(**paths).split()
    if script != "bench_scale.py":  # which writes its JSON beside its report
        argv += ["--json", str(figures)]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"},
        timeout=1800,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    written = figures if script != "bench_scale.py" else tmp_path / "report.json"
    assert json.loads(written.read_text(encoding="utf-8")), result.stdout[-2000:]
