"""Runs every benchmark and writes one Markdown report (default: runs/benchmarks.md).

Each benchmark runs as its own script in a subprocess, one after the other, so that the
memory one takes is returned before the next starts and a failure stops only that one. The
report has a header (machine, versions, date, git commit), a summary table of the key
figures beside their limits or peers (all measured in this run), the time and peak memory of
each benchmark, and each benchmark's own Markdown section. The figures also go to a JSON file
beside the report.

Run: ``python benchmarks/run_all.py [--only data,peer] [--quick] [--out runs/benchmarks.md]``
(``make bench``). ``--quick`` uses small sizes: a check that everything runs, in minutes,
whose figures are not the reference ones. A benchmark still running after ``--timeout``
seconds is stopped and reported as failed; one that needs more memory than is available is
skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

Row = tuple[str, str, str, str]
"""A summary row: figure, measured, limit or peer, ratio and goal."""
Figures = dict[str, Any]
"""A benchmark's JSON figures."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark script and how the report reads it."""

    name: str
    script: str
    title: str
    full: tuple[str, ...]
    """Arguments of the reference run."""
    quick: tuple[str, ...]
    """Arguments of ``--quick``."""
    summary: Callable[[Figures, dict[str, Figures]], list[Row]] | None = None
    """Summary rows from the script's JSON figures and those of the others, by name."""
    needs_gib: float = 2.0
    """Memory the full run needs, about: skipped with a note when less is available."""
    timeout: float | None = None
    """Seconds it may run; None: ``--timeout``."""


def _data_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    rows = []
    jobs = sorted(int(k.split("_j")[1].split("_")[0]) for k in r if k.startswith("build_j"))
    for j in sorted(set(jobs)):
        limit = r[f"spm_encode_j{j}_sentences_per_s"]
        rate = r[f"build_j{j}_sentences_per_s"]
        rows.append(
            (
                f"shard building, --jobs {j}",
                f"{rate / j:,.0f} sent/s per worker",
                f"raw SentencePiece encoding, {j} process(es): {limit:,.0f} sent/s each",
                f"{r[f'build_j{j}_per_worker_ratio']:.2f} (goal >= 0.80)",
            )
        )
    rows.append(
        ("shard size", f"{r['bytes_per_token']:.3f} bytes/token", "2.2 bytes/token", "goal <=")
    )
    train = others.get("train")
    loader = r["loader_w0_tokens_per_s"]
    if train:
        consumed = train["train_tokens_per_s"]
        rows.append(
            (
                "loader, in-process",
                f"{loader:,.0f} tokens/s",
                f"train.py consumption (tiny preset): {consumed:,.0f} tokens/s",
                f"{loader / consumed:,.0f}x (goal >= 10x)",
            )
        )
    rows.append(
        ("real tokens in batches", f"{r['real_token_fraction']:.3f}", "1.0", "goal >= 0.90")
    )
    return rows


def _share_goal(name: str, m: dict[str, float]) -> str:
    """The share of the peak beside issue 13's goal: 60% at the paper preset with the flat
    codebook; at tiny 1.5x the FLOP/s of the step before it, measured beside it by
    bench_revision.py (its 20% was a share of torch's BLAS peak, half the peak of the
    products the models now run)."""
    if name == "paper, flat":
        return f"{m['share_of_peak']:.0%} (goal >= 60%)"
    if name.startswith("paper"):
        return f"{m['share_of_peak']:.0%}"
    stock = m.get("stock_share_of_peak")
    by_stock = "" if stock is None else f"; torch's own count: {stock:.0%}"
    return f"{m['share_of_peak']:.0%}{by_stock} (goal: see the step before issue 13)"


def _retimed(m: dict[str, float]) -> str:
    rounds = int(m.get("rounds_retimed", 0))
    return f"; {rounds} round{'s' * (rounds != 1)} timed again, the heap grew" if rounds else ""


def _model_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    return (
        [
            (
                f"model step FLOP/s, {name}",
                f"{m['flops_per_s'] / 1e9:,.1f} GFLOP/s ({m['tokens_per_s']:,.0f} tokens/s; "
                f"step {m['step_s'] * 1e3:,.0f} ms, the first {m.get('first_step_s', 0):,.1f} s"
                f"{_retimed(m)})",
                f"fp32 matmul peak {m['matmul_peak'] / 1e9:,.1f} GFLOP/s (in turn)",
                _share_goal(name, m),
            )
            for name, m in r["results"].items()
        ]
        + [
            (
                f"model step, {name}: fused output layer and loss",
                f"{m['step_s'] * 1e3:,.0f} ms",
                f"output loss through autograd: {m['autograd_step_s'] * 1e3:,.0f} ms (in turn)",
                f"{m['fused_speedup']:.2f}x (goal > 1)",
            )
            for name, m in r["results"].items()
        ]
        + [
            (
                f"model step, {name}: compiled layers (--compile)",
                f"{m['compiled_step_s'] * 1e3:,.0f} ms, compiling {m['compile_s']:.0f} s",
                f"eager: {m['step_s'] * 1e3:,.0f} ms (in turn)",
                f"{m['compiled_speedup']:.2f}x",
            )
            for name, m in r["results"].items()
            if "compiled_step_s" in m
        ]
        + _allocator_rows(r.get("allocator"))
    )


def _revision_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    return [
        (
            f"tiny joint step, {layout}, against {r['against']} (before issue 13)",
            f"{f['now_step_s'] * 1e3:,.1f} ms, {f['now_flops_per_s'] / 1e9:,.1f} GFLOP/s",
            f"{r['against']}: {f['before_step_s'] * 1e3:,.1f} ms, "
            f"{f['before_flops_per_s'] / 1e9:,.1f} GFLOP/s (in turn)",
            f"FLOP/s {f['flops_per_s_ratio_vs_before']:.2f}x (goal >= 1.5x), "
            f"time {f['speedup_vs_before']:.2f}x",
        )
        for layout, f in r["results"].items()
    ]


def _allocator_rows(a: Figures | None) -> list[Row]:
    if not a:
        return []
    return [
        (
            "model step, tiny, varying shapes: freed host memory kept",
            f"{a['keep_step_s'] * 1e3:,.0f} ms, "
            f"{a['keep_faults_per_step']:,.0f} page faults a step",
            f"glibc's settings: {a['glibc_step_s'] * 1e3:,.0f} ms, "
            f"{a['glibc_faults_per_step']:,.0f} page faults (in turn)",
            f"{a['allocator_speedup']:.2f}x (goal > 1)",
        )
    ]


_PEER_GOALS = {"tiny": ">= 1.5x", "mid": ">= 1.1x"}
"""Issue 13's goals for the translation step against BART, by shape (other shapes: faster)."""


def _peer_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    rows = []
    for name, s in r["shapes"].items():
        ours, bart = s["models"]["megasemface"], s["models"]["HF BART"]
        rows.append(
            (
                f"translation training step, {name} (d {s['shape']['d_model']}, "
                f"{s['shape']['layers']} layers)",
                f"megasemface {ours['tokens_per_s']:,.0f} tokens/s",
                f"HF BART, same shape and batch: {bart['tokens_per_s']:,.0f} tokens/s",
                f"{s['ratio']:.2f}x (goal {_PEER_GOALS.get(name, '> 1')})",
            )
        )
    if r["device"].startswith("cuda"):
        peak = r["peak_flops"]
        for name, s in r["shapes"].items():
            ours = s["models"]["megasemface"]
            rows.append(
                (
                    f"GPU model FLOPs utilisation, {name}",
                    f"{ours['flops_per_s'] / 1e12:,.1f} TFLOP/s",
                    f"{r['device_name']} dense bf16 peak"
                    + (f" {peak / 1e12:,.0f} TFLOP/s" if peak else ": not in the table"),
                    f"{ours['flops_per_s'] / peak:.1%} MFU (goal >= 25%)" if peak else "",
                )
            )
    else:
        rows.append(("GPU model FLOPs utilisation", "skipped: no CUDA device", "", ""))
    return rows


def _train_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    return [
        (
            "train.py training (tiny, VQ joint, ZeRO-2)",
            f"{r['train_tokens_per_s']:,.0f} tokens/s",
            f"bare model step, before and after: {r['bare_tokens_per_s']:,.0f} tokens/s",
            f"{r['ratio']:.2f} (goal >= 0.90)",
        ),
        (
            "checkpoint stall",
            f"{r['checkpoint_seconds'] * 1e3:,.0f} ms per save",
            f"500 steps of {r['step_seconds'] * 1e3:,.0f} ms",
            f"{r['checkpoint_share']:.2%} of wall time (goal <= 1%)",
        ),
    ]


def _vq_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    cases = r["cases"]
    rows = []
    for layout, goal in (("flat", "goal ~0.5"), ("product", "replicated: ~1")):
        one, two = cases.get(f"{layout}/mp1"), cases.get(f"{layout}/mp2")
        if not one or not two:
            continue
        peak1, peak2 = max(x["peak_mb"] for x in one), max(x["peak_mb"] for x in two)
        time1, time2 = max(x["seconds"] for x in one), max(x["seconds"] for x in two)
        rows.append(
            (
                f"VQ layer {layout}, per-rank peak memory and time, mp 2",
                f"{peak2:,.1f} MiB, {time2:.3f} s",
                f"mp 1: {peak1:,.1f} MiB, {time1:.3f} s",
                f"memory {peak2 / peak1:.2f}x ({goal}), time {time2 / time1:.2f}x",
            )
        )
    return rows


def _demo_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    timings = r["timings"]
    total = timings["total_seconds"]
    kinds = ", ".join(f"{k} {s / 60:.1f}" for k, s in timings["by_kind"].items())
    return [
        (
            f"demo pipeline, {r['budget']} budget, from nothing (min: {kinds})",
            f"{total / 60:.1f} min",
            "make demo, install included: 20 min",
            f"{total / 1200:.0%} of the limit",
        )
    ]


def _translate_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    rows = []
    for preset, modes in r.items():
        bound = modes["teacher-forced"]["tokens_per_s"]
        for mode in ("greedy", "beam 5"):
            if mode in modes:
                rate = modes[mode]["tokens_per_s"]
                rows.append(
                    (
                        f"translation, {preset}, {mode}",
                        f"{rate:,.0f} output tokens/s",
                        f"teacher-forced scoring: {bound:,.0f} tokens/s",
                        f"{rate / bound:.1%}",
                    )
                )
        if "greedy" in modes and "greedy, no cache" in modes:
            cached = modes["greedy"]["tokens_per_s"]
            uncached = modes["greedy, no cache"]["tokens_per_s"]
            rows.append(
                (
                    f"translation, {preset}, greedy: key/value cache",
                    f"{cached:,.0f} output tokens/s",
                    f"no cache: {uncached:,.0f} tokens/s",
                    f"{cached / uncached:.2f}x",
                )
            )
    return rows


def _gpu_rows(r: Figures, others: dict[str, Figures]) -> list[Row]:
    if "skipped" in r:
        return [("GPU joint SemFace step, paper preset", f"skipped: {r['skipped']}", "", "")]
    steps, peak = r["steps"], r["datasheet_peak"]
    rows = []
    for stage in ("ZeRO-2", "ZeRO-3"):
        s = steps[stage]
        rows.append(
            (
                f"GPU joint SemFace step, {r['preset']} preset, flat VQ, bf16 {stage}",
                f"{s['flops_per_s'] / 1e12:,.0f} TFLOP/s, {s['tokens_per_s']:,.0f} tokens/s",
                f"{r['device']} dense bf16 peak"
                + (f" {peak / 1e12:,.0f} TFLOP/s" if peak else ": not in the table"),
                f"{s['mfu']:.1%} MFU (goal >= 45%)" if "mfu" in s else "",
            )
        )
    # The ZeRO-2 step beside variants without one of its speed-ups, from the same rounds.
    for variant, what, theirs in (
        ("ZeRO-2 eager VQ", "the VQ layer's fused kernels", "its eager passes"),
        ("ZeRO-2 per-tensor checks", "multi-tensor gradient checks", "DeepSpeed's own checks"),
    ):
        if variant in steps:
            ours_s, other = steps["ZeRO-2"], steps[variant]
            rows.append(
                (
                    f"GPU joint SemFace step, ZeRO-2: {what}",
                    f"{ours_s['tokens_per_s']:,.0f} tokens/s",
                    f"{theirs}: {other['tokens_per_s']:,.0f} tokens/s",
                    f"{ours_s['tokens_per_s'] / other['tokens_per_s']:.2f}x",
                )
            )
    ours, bart = steps["megasemface"], steps["HF BART"]
    rows.append(
        (
            "GPU translation training step, same shape, autocast bf16",
            f"megasemface {ours['tokens_per_s']:,.0f} tokens/s",
            f"HF BART: {bart['tokens_per_s']:,.0f} tokens/s",
            f"{ours['tokens_per_s'] / bart['tokens_per_s']:.2f}x (goal > 1)",
        )
    )
    return rows


BENCHMARKS = (
    Benchmark(
        "data",
        "bench_data.py",
        "Data path",
        ("--copies", "8"),
        ("--copies", "1"),
        _data_rows,
        needs_gib=3,
    ),
    Benchmark(
        "model",
        "bench_model.py",
        "Training step and FLOPs",
        ("--presets", "tiny,paper"),
        ("--presets", "tiny"),
        _model_rows,
        needs_gib=12,
    ),
    Benchmark(
        "revision",
        "bench_revision.py",
        "The tiny joint step against the revision before issue 13",
        (),
        ("--rounds", "1", "--steps", "5"),
        _revision_rows,
        needs_gib=2,
    ),
    Benchmark(
        "peer",
        "bench_peer.py",
        "megasemface vs Hugging Face BART",
        (),
        ("--shapes", "tiny", "--repeats", "5"),
        _peer_rows,
        needs_gib=4,
    ),
    Benchmark(
        "train",
        "bench_train.py",
        "Training path and checkpoint stall",
        ("--steps", "60"),
        ("--steps", "20"),
        _train_rows,
        needs_gib=3,
    ),
    Benchmark(
        "translate",
        "bench_translate.py",
        "Translation",
        ("--presets", "tiny,paper"),
        ("--presets", "tiny", "--repeats", "1"),
        _translate_rows,
        needs_gib=4,
    ),
    Benchmark(
        "vq",
        "bench_vq.py",
        "VQ layer by layout and model-parallel size",
        (),
        ("--tokens", "64", "--codes", "8192", "--d-model", "256", "--hidden", "256"),
        _vq_rows,
        needs_gib=6,
    ),
    Benchmark(
        "demo",
        "bench_demo.py",
        "The demo pipeline, step by step",
        (),
        ("--budget", "smoke"),
        _demo_rows,
        needs_gib=6,
        timeout=2400,
    ),
    Benchmark(
        "gpu",
        "bench_gpu.py",
        "GPU: the joint SemFace step under DeepSpeed beside HF BART",
        ("--profile",),
        ("--sentences", "128", "--repeats", "3", "--no-compile"),
        _gpu_rows,
        needs_gib=8,
    ),
    Benchmark(
        "embeddings",
        "bench_embeddings.py",
        "Cross-lingual embeddings",
        (),
        ("--vocab", "8000", "--dim", "128"),
        needs_gib=4,
    ),
)


@dataclasses.dataclass
class Outcome:
    """What one benchmark's run left."""

    status: str
    seconds: float = 0.0
    max_rss_mib: float = 0.0
    """Largest resident set of any one of its processes (from the kernel)."""
    tree_rss_mib: float = 0.0
    """Largest sum over its process tree (sampled twice a second)."""
    load: float = 0.0
    """Mean 1-minute load average while it ran (its own threads included)."""
    markdown: str = ""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


def _echo(stream: IO[str], sink: IO[str], keep: list[str]) -> None:
    for line in stream:
        sink.write(line)
        sink.flush()
        keep.append(line)


def _tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        total = root.memory_info().rss
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it may have just ended
                total += child.memory_info().rss
        return total
    except psutil.Error:
        return 0


def run_one(bench: Benchmark, args: list[str], timeout: float) -> Outcome:
    """Runs one script (stdout: its Markdown, echoed as it comes) and reads the figures it
    writes with ``--json``."""
    script = HERE / bench.script
    if not script.exists():
        return Outcome(f"skipped: {bench.script} is not in this checkout")
    with tempfile.TemporaryDirectory(prefix=f"bench-{bench.name}-") as tmp:
        figures_path = Path(tmp) / "figures.json"
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, str(script), *args, "--json", str(figures_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends all of it
        )
        out: list[str] = []
        err: list[str] = []
        readers = [
            threading.Thread(target=_echo, args=(proc.stdout, sys.stdout, out), daemon=True),
            threading.Thread(target=_echo, args=(proc.stderr, sys.stderr, err), daemon=True),
        ]
        for reader in readers:
            reader.start()
        tree_peak = 0
        loads: list[float] = []
        timed_out = False
        try:
            while True:
                # wait4 gives this child's own resource use: ru_maxrss (KiB on Linux) is the
                # largest resident set of it and the descendants it waited for.
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                tree_peak = max(tree_peak, _tree_rss(proc.pid))
                loads.append(os.getloadavg()[0])
                if time.perf_counter() - started > timeout and not timed_out:
                    os.killpg(proc.pid, signal.SIGKILL)
                    timed_out = True
                time.sleep(0.5)
        except BaseException:  # Ctrl-C included: its own session does not get the signal
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        seconds = time.perf_counter() - started
        for reader in readers:
            reader.join()
        figures = {}
        if figures_path.exists():
            figures = json.loads(figures_path.read_text(encoding="utf-8"))
    markdown = "".join(out).strip()
    if timed_out:
        status = f"failed: stopped after {timeout:.0f} s"
    elif proc.returncode:
        status = f"failed: exit {proc.returncode}"
        markdown += "\n\n```\n" + "".join(err[-20:]).rstrip() + "\n```"
    else:
        status = "ok"
    load = sum(loads) / len(loads) if loads else os.getloadavg()[0]
    return Outcome(
        status, seconds, usage.ru_maxrss / 2**10, tree_peak / 2**20, load, markdown, figures
    )


def cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (commit or "unknown") + (" (with uncommitted changes)" if dirty else "")


def header(quick: bool, outcomes: dict[str, Outcome], load: tuple[float, ...]) -> list[str]:
    """Title and the machine the figures come from (``load``: the load average at the start)."""
    memory = psutil.virtual_memory().total / 2**30
    count = cores()
    peer = outcomes.get("peer")
    gpu = peer.figures.get("device_name") if peer else None
    return [
        "# megasemface benchmarks" + (" (quick: small sizes, not reference figures)" * quick),
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- git commit: {git_commit()}",
        f"- machine: {cpu_model()}, {count} cores, {memory:.0f} GiB memory"
        + (f", GPU {gpu}" if gpu else ", no GPU"),
        f"- Python {platform.python_version()}, torch {_version('torch')}, "
        f"deepspeed {_version('deepspeed')}, transformers {_version('transformers')}",
        f"- load average (1, 5, 15 min) at the start: {', '.join(f'{x:.1f}' for x in load)}",
        "",
        "Every figure stands beside its limit or peer measured in the same run on the same "
        "machine: absolute times vary with the machine and its load, the ratios are what to "
        "read.",
    ]


def summary(outcomes: dict[str, Outcome]) -> list[str]:
    """The key figures of every benchmark that ran, beside their limits or peers."""
    every = {name: o.figures for name, o in outcomes.items() if o.figures}
    rows = ["| figure | measured | limit or peer (same run) | ratio, goal |", "|---|---|---|---|"]
    for bench in BENCHMARKS:
        outcome = outcomes.get(bench.name)
        if outcome is None or bench.summary is None or not outcome.figures:
            continue
        try:
            rows += [f"| {' | '.join(row)} |" for row in bench.summary(outcome.figures, every)]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            rows.append(f"| {bench.name} | figures unreadable ({error!r}) | | |")
    return rows


def runtimes(outcomes: dict[str, Outcome]) -> list[str]:
    """Wall time, peak memory and machine load of each benchmark."""
    count = cores()
    rows = [
        "| benchmark | status | wall time | peak memory: process tree / largest process "
        "| load average while it ran |",
        "|---|---|---|---|---|",
    ]
    for name, o in outcomes.items():
        rows.append(
            f"| {name} | {o.status} | {o.seconds:,.0f} s | "
            f"{o.tree_rss_mib / 1024:,.1f} / {o.max_rss_mib / 1024:,.1f} GiB | {o.load:.1f} |"
        )
    total = sum(o.seconds for o in outcomes.values())
    rows += [
        "",
        f"Total: {total / 60:,.1f} min. A benchmark's own threads put about {count} in the load "
        f"average of this {count}-core machine; more means other work shared the cores.",
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    names = [b.name for b in BENCHMARKS]
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks.md")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--quick", action="store_true", help="small sizes: a fast check")
    parser.add_argument("--locale-dir", type=Path, default=Path("/usr/share/locale"))
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per benchmark")
    args = parser.parse_args(argv)
    selected = names if not args.only else args.only.split(",")
    unknown = sorted(set(selected) - set(names))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {names}")

    # SIGTERM unwinds like Ctrl-C, so that the running benchmark's process group is ended too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load = os.getloadavg()  # other work on the machine slows every figure
    outcomes: dict[str, Outcome] = {}
    sections: list[str] = []
    for bench in BENCHMARKS:
        if bench.name not in selected:
            continue
        available = psutil.virtual_memory().available / 2**30
        print(f"\n=== {bench.name}: {bench.script} ({available:.1f} GiB available) ===", flush=True)
        extra = list(bench.quick if args.quick else bench.full)
        if bench.name in ("data", "train", "demo", "embeddings"):
            extra += ["--locale-dir", str(args.locale_dir)]
        if not args.quick and available < bench.needs_gib:
            outcome = Outcome(
                f"skipped: {available:.1f} GiB available, needs about {bench.needs_gib:.0f}"
            )
        else:
            outcome = run_one(bench, extra, bench.timeout or args.timeout)
        outcomes[bench.name] = outcome
        print(f"=== {bench.name}: {outcome.status}, {outcome.seconds:,.0f} s ===", flush=True)
        command = " ".join(["python", f"benchmarks/{bench.script}", *extra])
        sections += ["", f"## {bench.title} ({bench.name})", "", f"`{command}`", ""]
        sections.append(outcome.markdown or f"({outcome.status})")

    lines = [
        *header(args.quick, outcomes, load),
        "",
        "## Summary",
        "",
        *summary(outcomes),
        "",
        "## Time and memory of each benchmark",
        "",
        *runtimes(outcomes),
        *sections,
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    figures = {name: dataclasses.asdict(o) for name, o in outcomes.items()}
    args.out.with_suffix(".json").write_text(json.dumps(figures, indent=1) + "\n")
    print("\n" + "\n".join(lines[: lines.index("## Time and memory of each benchmark") + 2]))
    print("\n".join(runtimes(outcomes)))
    print(f"\nreport written to {args.out}")
    failed = [name for name, o in outcomes.items() if o.status.startswith("failed")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
