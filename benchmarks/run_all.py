"""Runs every benchmark and writes one Markdown report (default: runs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_data  # sibling scripts, not package modules
import bench_model
import bench_train
import bench_vq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks.md"))
    parser.add_argument("--locale-dir", type=Path, default=Path("/usr/share/locale"))
    args = parser.parse_args(argv)
    sections = [
        "# megasemface benchmarks",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Each figure stands beside its limit or goal "
        "measured in the same run.",
        "",
        "## Data path (benchmarks/bench_data.py)",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        results = bench_data.run(8, args.locale_dir, Path(tmp))
    sections.append(bench_data.report(results))
    peak, model_results = bench_model.run(["tiny", "paper"])
    sections += ["", "## Training step (benchmarks/bench_model.py)", ""]
    sections.append(bench_model.report(peak, model_results))
    train_results = bench_train.run(60, args.locale_dir)
    sections += ["", "## Training path (benchmarks/bench_train.py)", ""]
    sections.append(bench_train.report(train_results))
    vq_results = bench_vq.run(256, 102_400, 1024, 1024, 128, 3)
    sections += ["", "## VQ layer (benchmarks/bench_vq.py)", ""]
    sections.append(bench_vq.report(vq_results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections) + "\n", encoding="utf-8")
    print("\n".join(sections))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
