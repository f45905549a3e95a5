"""The data path at the scale it is built for: 50M sentences a language, stage by stage.

It writes a monolingual corpus of ``--sentences`` news-length sentences per language
(``megasemface.data.demo.synthetic_corpus``: a seeded generator over the words of the demo
corpus's gettext catalogs, which every Linux machine has) as ``.txt.gz`` or plain text, then
takes it through the project's own tools, each stage in its own process:

1. ``tools/train_spm.py`` (reservoir sampling, then SentencePiece on the bounded sample);
2. ``tools/build_shards.py --jobs 2 --dedup`` (sentences/s, tokens/s, bytes per token, the
   de-duplication table's size; the main process's and the workers' CPU time, from which the
   rate at ``--jobs 15`` on 16 cores follows);
3. one full pass of the training loader over the shards at the paper preset's batch
   (``--max-tokens 16384``, sentences up to 254 tokens): tokens/s per loader worker, and the
   workers 8 GPUs at 47,500 tokens/s each need; the loader's state is saved past 80% of the
   epoch;
4. the loader resumed from that state in a fresh process: time to its first batch, and
   whether its batches are the ones the uninterrupted pass yielded there.

Each stage's wall time, CPU time, peak memory (the largest sum over its process tree, PSS,
polled four times a second; the largest single process, from the kernel) and disk go to a JSON
report and a Markdown table with the date, commit and machine. The corpus and everything
built from it are deleted afterwards unless ``--keep``; a kept corpus made with the same
options is reused (``--corpus-only`` writes it and stops, so that it can be made ahead).

Run: ``python benchmarks/bench_scale.py [--sentences 50000000] [--languages en,de]``
(``make bench-scale SCALE_ARGS="..."``); ``--smoke`` is the smallest run, a check. It is
not part of ``make bench``: at the default size it needs hours, about 7 GB of disk per
language (12 GB with plain text) and an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from run_all import cores, cpu_model, git_commit  # sibling script

from megasemface.data.demo.demo_corpus import (
    DEFAULT_LOCALE_DIR,
    SOURCE_LANG,
    DemoCorpusError,
    build_demo_corpus,
)
from megasemface.data.demo.synthetic_corpus import SyntheticCorpusConfig, WordSource, write_corpus
from megasemface.data.text.hashset import HashSet

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 1 << 30
MEMORY_GOAL_GIB = 8.0
RESUME_GOAL_S = 30.0
# Bytes of disk a sentence needs, about, as measured at 200k sentences of 27 words: the
# corpus (.txt.gz or plain) and its shards, before the corpus is deleted.
_DISK_PER_SENTENCE = {"gz": 65 + 100, "txt": 171 + 100}


# Measuring a stage ---------------------------------------------------------------------------


def _tree_memory(root: psutil.Process) -> tuple[int, float, int]:
    """The proportional set size summed over a process and its descendants (shared pages
    counted once, where a sum of RSS would count forked workers' shared pages again), the
    process's own CPU seconds, and how many descendants it has."""
    total, own = 0, 0.0
    children = root.children(recursive=True)
    for proc in [root, *children]:
        with contextlib.suppress(psutil.Error):  # it may have just ended
            info = proc.memory_full_info()
            total += getattr(info, "pss", info.rss)
            if proc.pid == root.pid:
                times = proc.cpu_times()
                own = times.user + times.system
    return total, own, len(children)


def run_stage(name: str, argv: list[str], log: Path) -> dict[str, Any]:
    """Runs one stage's command (output to ``log``) and measures it: wall and CPU seconds of
    the whole tree and of its main process, peak memory of the tree and of its largest
    process, and the wall and main-process CPU seconds while it had worker processes (its
    work, without the start-up and the exit that a longer run spreads over more lines).
    Raises RuntimeError, with the log's last lines, if it fails."""
    # The checkout this script is in, not whatever megasemface the environment installed.
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    print(f"[{name}] {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env)
    root = psutil.Process(proc.pid)
    peak_tree, main_cpu = 0, 0.0
    # (seconds since the start, main-process CPU seconds) at the first and the last poll that
    # found worker processes.
    first: tuple[float, float] | None = None
    last = (0.0, 0.0)
    while True:
        # wait4 gives this child's own resources: the CPU time of it and of the descendants
        # it waited for, and the largest resident set among them (KiB on Linux).
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        with contextlib.suppress(psutil.Error):
            tree, own, children = _tree_memory(root)
            peak_tree, main_cpu = max(peak_tree, tree), max(main_cpu, own)
            if children:
                last = (time.perf_counter() - started, own)
                first = first or last
        time.sleep(0.25)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{name} failed (exit {code}); the end of {log}:\n" + "\n".join(tail))
    cpu = usage.ru_utime + usage.ru_stime
    figures = {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "main_cpu_seconds": min(main_cpu, cpu),
        "working_seconds": last[0] - first[0] if first else seconds,
        "working_main_cpu_seconds": last[1] - first[1] if first else main_cpu,
        "peak_tree_gib": peak_tree / GIB,
        "peak_process_gib": usage.ru_maxrss * 1024 / GIB,
    }
    print(f"[{name}] {_duration(seconds)}, peak {peak_tree / GIB:.2f} GiB", flush=True)
    return figures


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# Stages --------------------------------------------------------------------------------------


def make_corpus(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The corpus files, one per language (reused when a kept one has the same options)."""
    config = SyntheticCorpusConfig(sentences=args.sentences, seed=args.seed)
    options = {"config": dataclasses.asdict(config), "format": args.format}
    options["gzip_level"] = args.gzip_level
    stamp = work / "corpus" / "corpus.json"
    if stamp.exists():
        made = json.loads(stamp.read_text(encoding="utf-8"))
        if made["options"] == options and made["languages"] == args.languages:
            print(f"[corpus] reusing {stamp.parent}", flush=True)
            return made
    shutil.rmtree(work / "corpus", ignore_errors=True)
    (work / "corpus").mkdir(parents=True)
    started = time.perf_counter()
    targets = [lang for lang in args.languages if lang != SOURCE_LANG] or ["de"]
    build_demo_corpus(args.locale_dir, targets, work / "catalogs")
    files = {}
    for lang in args.languages:
        source = WordSource.from_file(work / "catalogs" / "mono" / f"{lang}.txt")
        path = work / "corpus" / (f"{lang}.txt" + (".gz" if args.format == "gz" else ""))
        print(f"[corpus] writing {args.sentences:,} sentences to {path}", flush=True)
        files[lang] = write_corpus(source, path, config, stream=lang, compresslevel=args.gzip_level)
        files[lang]["source_words"] = source.num_words
    made = {
        "options": options,
        "languages": args.languages,
        "files": files,
        "seconds": time.perf_counter() - started,
    }
    stamp.write_text(json.dumps(made, indent=1) + "\n", encoding="utf-8")  # last: complete
    return made


def train_spm_stage(args: argparse.Namespace, work: Path, corpus: dict) -> dict[str, Any]:
    prefix = work / "spm" / "joint"
    argv = [sys.executable, "tools/train_spm.py", "--output", str(prefix)]
    argv += [f"--input={lang}:{info['path']}" for lang, info in corpus["files"].items()]
    argv += ["--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]
    argv += ["--max-sentences-per-lang", str(args.max_sentences_per_lang)]
    figures = run_stage("train_spm", argv, args.logs / "train_spm.log")
    report = json.loads(prefix.with_suffix(".json").read_text(encoding="utf-8"))
    lines = sum(info["lines_read"] for info in report["per_language"].values())
    return figures | {
        "sampling_seconds": report["seconds"]["sampling"],
        "training_seconds": report["seconds"]["training"],
        "training_sentences": report["training_sentences"],
        "lines_read": lines,
        "disk_bytes": _size(prefix.with_suffix(".model")) + _size(prefix.with_suffix(".vocab")),
    }


def build_shards_stage(args: argparse.Namespace, work: Path, corpus: dict) -> dict[str, Any]:
    out = work / "shards"
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "tools/build_shards.py", "--spm-model", str(work / "spm/joint.model")]
    argv += [f"--input={lang}:{info['path']}" for lang, info in corpus["files"].items()]
    argv += ["--out", str(out), "--jobs", str(args.jobs), "--dedup", "--quiet"]
    figures = run_stage("build_shards", argv, args.logs / "build_shards.log")
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    totals = manifest["totals"]
    langs = manifest["languages"].values()
    lines = sum(info["lines"] for info in langs)
    # Every line that passes the text filters is hashed, and the distinct ones fill the
    # table; each language has its own, freed before the next language's.
    distinct = max(info["sentences"] + info["filtered"].get("too_long_tokens", 0) for info in langs)
    seconds, workers_cpu = figures["seconds"], figures["cpu_seconds"] - figures["main_cpu_seconds"]
    main_work_cpu = figures["working_main_cpu_seconds"]
    return figures | {
        "jobs": args.jobs,
        "lines": lines,
        "sentences": totals["sentences"],
        "tokens": totals["tokens"],
        "tokens_per_sentence": totals["tokens"] / max(totals["sentences"], 1),
        "sentences_per_s": totals["sentences"] / seconds,
        "lines_per_s": lines / seconds,
        "tokens_per_s": totals["tokens"] / seconds,
        "bytes_per_token": totals["bytes_per_token"],
        "disk_bytes": _size(out),
        "shards": totals["shards"],
        "filtered": {
            key: sum(info["filtered"].get(key, 0) for info in langs)
            for key in next(iter(langs))["filtered"]
        },
        "dedup_distinct": distinct,
        "dedup_table_gib": HashSet.nbytes_for(distinct) / GIB,
        "dedup_growing_gib": 1.5 * HashSet.nbytes_for(distinct) / GIB,
        # Lines a CPU second of each kind of process handles: what --jobs J can reach.
        "worker_lines_per_cpu_s": lines / max(workers_cpu, 1e-9),
        "main_lines_per_cpu_s": lines / max(main_work_cpu, 1e-9),
        "main_busy": main_work_cpu / max(figures["working_seconds"], 1e-9),
    }


def loader_stage(args: argparse.Namespace, work: Path, stage: str) -> dict[str, Any]:
    argv = [sys.executable, str(HERE / "bench_scale.py"), "--stage", stage, "--workdir", str(work)]
    argv += ["--loader-workers", str(args.loader_workers), "--max-tokens", str(args.max_tokens)]
    argv += ["--resume-at", str(args.resume_at), "--seed", str(args.seed)]
    argv += ["--check-batches", str(args.check_batches)]
    figures = run_stage(f"loader-{stage}", argv, args.logs / f"loader-{stage}.log")
    own = json.loads((work / f"loader-{stage}.json").read_text(encoding="utf-8"))
    return figures | own


# The loader's pass and resume, each run in its own process (``--stage``) -----------------------


def _loader(args: argparse.Namespace, work: Path) -> tuple[Any, int]:
    """The loader the paper runs read with, over the shards; the sentences of an epoch."""
    from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource
    from megasemface.data.shards.shard_format import Manifest
    from megasemface.data.text.tokenizer import PAD_ID
    from megasemface.nn.config import build_model_config

    source = ShardSource.from_manifest(Manifest.load(work / "shards"))
    # The paper preset's longest sentence, less the language tag and </s> the model adds.
    max_len = build_model_config("paper").max_len - 2
    config = LoaderConfig(
        max_tokens=args.max_tokens, max_len=max_len, num_workers=args.loader_workers, seed=args.seed
    )
    return ShardLoader(source, config, pad_id=PAD_ID), sum(source.sizes.values())


def _digest(batch: Any) -> str:
    digest = hashlib.sha256(batch.lang.encode())
    digest.update(batch.tokens.numpy().tobytes())
    digest.update(batch.sentence_ids.numpy().tobytes())
    return digest.hexdigest()


def run_loader_pass(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One epoch; the state once ``resume_at`` of it is read, and the batches that follow."""
    loader, total = _loader(args, work)
    started = time.perf_counter()
    seen, batches, first, tokens_at_first, state = 0, 0, 0.0, 0, None
    expected: list[str] = []
    finished: set[int] = set()  # slots well into their second epoch: a guard, see below
    for batch in loader:
        if batches == 0:
            first = time.perf_counter() - started
            tokens_at_first = loader.stats()["tokens"]
        batches += 1
        if state is not None and len(expected) < args.check_batches:
            expected.append(_digest(batch))
        seen += int((batch.epochs == 0).sum())
        if state is None and seen >= args.resume_at * total:
            state = {"state": loader.state_dict(), "position": seen / total, "batch": batches}
        if int(batch.epochs.min()) >= 2:  # a sentence never delivered must not hang the pass
            finished.add(batch.slot)
        done = seen >= total or len(finished) == loader.num_slots
        if done and len(expected) >= args.check_batches:
            break
    seconds = time.perf_counter() - started
    stats = loader.stats()
    assert state is not None
    state["expected"] = expected
    (work / "loader-state.json").write_text(json.dumps(state) + "\n", encoding="utf-8")
    return {
        "workers": args.loader_workers,
        "max_tokens": args.max_tokens,
        "batches": batches,
        "epoch_sentences": total,
        "epoch_sentences_seen": seen,
        "tokens": stats["tokens"],
        "real_token_fraction": stats["tokens"] / max(stats["padded"], 1),
        "first_batch_seconds": first,
        "pass_seconds": seconds,
        "tokens_per_s": (stats["tokens"] - tokens_at_first) / max(seconds - first, 1e-9),
        "state_position": state["position"],
        "state_batch": state["batch"],
    }


def run_loader_resume(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    saved = json.loads((work / "loader-state.json").read_text(encoding="utf-8"))
    loader, _ = _loader(args, work)
    started = time.perf_counter()
    loader.load_state_dict(saved["state"])
    stream = iter(loader)
    got = [_digest(next(stream))]
    first = time.perf_counter() - started
    got += [_digest(next(stream)) for _ in saved["expected"][1:]]
    return {
        "position": saved["position"],
        "batch": saved["batch"],
        "first_batch_seconds": first,
        "batches_compared": len(saved["expected"]),
        "exact": got == saved["expected"],
    }


# Report --------------------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value:.2f} GiB" + (" (over 8 GiB)" if value > MEMORY_GOAL_GIB else "")


def _row(name: str, stage: dict[str, Any], disk: str, what: str) -> str:
    return (
        f"| {name} | {_duration(stage['seconds'])} | {_duration(stage['cpu_seconds'])} "
        f"| {_gib(stage['peak_tree_gib'])} / {_gib(stage['peak_process_gib'])} | {disk} "
        f"| {what} |"
    )


def _stage_rows(results: dict[str, Any]) -> list[str]:
    spm, shards = results["train_spm"], results["build_shards"]
    loader, resume = results["loader_pass"], results["loader_resume"]
    sampling = spm["sampling_seconds"]
    return [
        "| stage | wall time | CPU time | peak memory: process tree (PSS) / largest process "
        "| disk | figures |",
        "|---|---|---|---|---|---|",
        _row(
            "`tools/train_spm.py`",
            spm,
            f"{spm['disk_bytes'] / 2**20:,.1f} MiB",
            f"{spm['lines_read']:,} lines read and sampled in {_duration(sampling)} "
            f"({spm['lines_read'] / max(sampling, 1e-9):,.0f} lines/s); SentencePiece on "
            f"{spm['training_sentences']:,} sentences in {_duration(spm['training_seconds'])}",
        ),
        _row(
            f"`tools/build_shards.py --jobs {shards['jobs']} --dedup`",
            shards,
            f"{shards['disk_bytes'] / GIB:.2f} GiB in {shards['shards']} shards",
            f"{shards['sentences_per_s']:,.0f} sentences/s, {shards['tokens_per_s']:,.0f} "
            f"tokens/s ({shards['tokens_per_sentence']:.1f} tokens a sentence), "
            f"{shards['bytes_per_token']:.3f} bytes/token; {shards['filtered']['duplicate']:,} "
            f"duplicates dropped; dedup table {shards['dedup_table_gib'] * 1024:,.0f} MiB for "
            f"{shards['dedup_distinct']:,} distinct lines "
            f"({shards['dedup_growing_gib'] * 1024:,.0f} MiB while it doubles); main process "
            f"busy {shards['main_busy']:.0%} of the time while the workers ran",
        ),
        _row(
            f"loader, one pass, {loader['workers']} worker(s), {loader['max_tokens']:,}-token "
            "batches",
            loader,
            "",
            f"{loader['tokens']:,} tokens in {loader['batches']:,} batches: "
            f"{loader['tokens_per_s']:,.0f} tokens/s, {loader['tokens_per_worker_cpu_s']:,.0f} "
            f"per worker CPU second; real tokens {loader['real_token_fraction']:.1%}",
        ),
        _row(
            f"loader resumed at {resume['position']:.1%} of the epoch",
            resume,
            "",
            f"first batch after {_duration(resume['first_batch_seconds'])} (the pass took "
            f"{_duration(loader['pass_seconds'] * resume['position'])} to get there); the next "
            f"{resume['batches_compared']} batches "
            + ("equal the uninterrupted pass's" if resume["exact"] else "**differ**"),
        ),
    ]


def _consequences(results: dict[str, Any]) -> list[str]:
    shards, loader, resume = (
        results["build_shards"],
        results["loader_pass"],
        results["loader_resume"],
    )
    jobs, gpus, speed = results["extrapolate_jobs"], results["gpus"], results["gpu_tokens_per_s"]
    workers_rate = jobs * shards["worker_lines_per_cpu_s"]
    at_jobs = min(workers_rate, shards["main_lines_per_cpu_s"])
    all_lines = shards["lines"]
    per_gpu = math.ceil(speed / loader["tokens_per_worker_cpu_s"])
    memory = all(results[s]["peak_tree_gib"] <= MEMORY_GOAL_GIB for s in _STAGES)
    return [
        f"- `--jobs {jobs}` on {jobs + 1} cores: an encoding worker handles "
        f"{shards['worker_lines_per_cpu_s']:,.0f} lines per CPU second and the main process "
        f"{shards['main_lines_per_cpu_s']:,.0f}, so the build would run at about "
        f"{at_jobs:,.0f} lines/s ({_duration(all_lines / at_jobs)} for this corpus), limited "
        + ("by the main process." if at_jobs < workers_rate else "by the workers."),
        f"- {gpus} GPUs at {speed:,} tokens/s each: {per_gpu} loader worker(s) per GPU "
        f"({gpus * per_gpu} in all) at {loader['tokens_per_worker_cpu_s']:,.0f} tokens per "
        "worker CPU second on this machine.",
        f"- Goals: every stage under {MEMORY_GOAL_GIB:.0f} GiB: "
        + ("met" if memory else "**not met**")
        + f"; the resume's first batch under {RESUME_GOAL_S:.0f} s: "
        + ("met" if resume["first_batch_seconds"] < RESUME_GOAL_S else "**not met**")
        + ("" if resume["exact"] else "; the resumed batches **differ**")
        + ".",
    ]


def report(results: dict[str, Any]) -> str:
    """The Markdown report: the machine, the corpus, a line per stage, what follows."""
    corpus = results["corpus"]
    files = list(corpus["files"].values())
    lines = sum(f["lines"] for f in files)
    percentiles = " / ".join(str(v) for v in files[0]["words_percentiles"].values())
    return "\n".join(
        [
            f"Data path at {results['sentences']:,} sentences per language "
            f"({', '.join(results['languages'])}): {results['date']}, commit "
            f"{results['commit']}, {results['machine']}.",
            "",
            f"Corpus: {lines:,} lines of {sum(f['words'] for f in files) / lines:.1f} words on "
            f"average (p50 / p90 / p99 / max in {results['languages'][0]}: {percentiles}), "
            f"{sum(f['disk_bytes'] for f in files) / GIB:.2f} GiB as {results['format']}, "
            f"written in {_duration(corpus['seconds'])}; the work directory held "
            f"{results['workdir_bytes'] / GIB:.2f} GiB at the end (corpus, model, shards).",
            "",
            *_stage_rows(results),
            "",
            *_consequences(results),
        ]
    )


_PACKAGES = ("sentencepiece", "numpy", "torch", "webdataset")
SMOKE: dict[str, Any] = {
    "sentences": 2000,
    "vocab_size": 1000,
    "max_sentences_per_lang": 2000,
    "max_tokens": 2048,
    "check_batches": 1,
    "threads": 1,
    "jobs": 1,
}
"""``--smoke``'s options."""
_STAGES = ("train_spm", "build_shards", "loader_pass", "loader_resume")


def _check_disk(args: argparse.Namespace, work: Path) -> None:
    need = args.sentences * len(args.languages) * _DISK_PER_SENTENCE[args.format]
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(
            f"bench_scale: error: {work} has {free / GIB:.1f} GiB free; the corpus and its "
            f"shards need about {need / GIB:.1f} GiB: give a --workdir on a larger disk or "
            "fewer --sentences"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--sentences", type=int, default=50_000_000, help="per language (default: %(default)s)")
    add("--languages", default="en", help="comma-separated, of the demo catalogs (default: en)")
    add("--format", choices=("gz", "txt"), default="gz", help="the corpus files' format")
    add("--gzip-level", type=int, default=6, help="as gzip's default (default: %(default)s)")
    add("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    add("--workdir", type=Path, default=ROOT / "runs" / "bench-scale" / "work")
    add("--out", type=Path, default=ROOT / "runs" / "bench-scale" / "report.md")
    add("--keep", action="store_true", help="keep the corpus, model and shards")
    add(
        "--corpus-only",
        action="store_true",
        help="write the corpus, keep it and stop: a later run with the same options (and "
        "--keep) starts from it",
    )
    add(
        "--vocab-size",
        type=int,
        help="default: the paper's 60000 with two or more languages; 30000 with one, as the "
        "catalogs' English words alone give at most about 31,700 pieces",
    )
    add("--max-sentences-per-lang", type=int, default=1_000_000)
    add("--threads", type=int, default=cores(), help="train_spm's (default: the cores)")
    add("--jobs", type=int, default=2, help="build_shards' (default: %(default)s)")
    add("--loader-workers", type=int, default=1)
    add("--max-tokens", type=int, default=16384, help="the loader's batch, the paper runs'")
    add("--resume-at", type=float, default=0.8, help="share of the epoch to resume at")
    add("--check-batches", type=int, default=4, help="batches compared after the resume")
    add("--gpus", type=int, default=8)
    add("--gpu-tokens-per-s", type=int, default=47_500, help="one H200's, docs/results.md")
    add("--extrapolate-jobs", type=int, default=15)
    add("--seed", type=int, default=0)
    add(
        "--smoke",
        action="store_true",
        help=f"the smallest run, a check that every stage works (no figures to keep): "
        f"{SMOKE['sentences']:,} sentences, a {SMOKE['vocab_size']:,}-piece model, batches "
        f"of {SMOKE['max_tokens']:,} tokens, one batch compared after the resume",
    )
    add("--stage", choices=("pass", "resume"), help=argparse.SUPPRESS)  # a loader stage's process
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.sentences < 1 or args.jobs < 1 or args.loader_workers < 0 or args.check_batches < 1:
        parser.error("--sentences, --jobs and --check-batches must be >= 1, --loader-workers >= 0")
    if not 0 < args.resume_at < 1:
        parser.error(f"--resume-at must be in (0, 1), got {args.resume_at}")
    args.languages = args.languages.split(",")
    if args.vocab_size is None:
        args.vocab_size = 60000 if len(args.languages) > 1 else 30000
    work = args.workdir.resolve()
    if args.stage:
        run = run_loader_pass if args.stage == "pass" else run_loader_resume
        out = run(args, work)
        (work / f"loader-{args.stage}.json").write_text(json.dumps(out) + "\n", encoding="utf-8")
        return 0

    work.mkdir(parents=True, exist_ok=True)
    # Beside the report, so that a failed stage's log outlives the deleted work directory.
    args.logs = args.out.parent / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    if not (work / "corpus" / "corpus.json").exists():
        _check_disk(args, work)
    memory = psutil.virtual_memory().total / GIB
    results: dict[str, Any] = {
        "date": f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        "commit": git_commit(),
        "machine": f"{cpu_model()}, {cores()} cores, {memory:.0f} GiB memory, Python "
        f"{platform.python_version()}, "
        + ", ".join(f"{name} {importlib.metadata.version(name)}" for name in _PACKAGES),
        "sentences": args.sentences,
        "languages": args.languages,
        "format": args.format,
        "gpus": args.gpus,
        "gpu_tokens_per_s": args.gpu_tokens_per_s,
        "extrapolate_jobs": args.extrapolate_jobs,
        "load_average_at_start": os.getloadavg(),
    }
    try:
        results["corpus"] = corpus = make_corpus(args, work)
        if args.corpus_only:
            print(f"the corpus is in {work / 'corpus'}; run again with --keep to measure")
            return 0
        results["train_spm"] = train_spm_stage(args, work, corpus)
        results["build_shards"] = build_shards_stage(args, work, corpus)
        results["loader_pass"] = loader_stage(args, work, "pass")
        results["loader_resume"] = loader_stage(args, work, "resume")
    except (RuntimeError, DemoCorpusError) as exc:
        print(f"bench_scale: error: {exc}", file=sys.stderr)
        return 1
    finally:
        results["workdir_bytes"] = _size(work)
        if not (args.keep or args.corpus_only):
            shutil.rmtree(work, ignore_errors=True)
    loader = results["loader_pass"]
    # With workers, the main process only receives batches (and stands for the training
    # process); without, it reads them itself.
    loader["worker_cpu_seconds"] = loader["cpu_seconds"] - (
        loader["main_cpu_seconds"] if args.loader_workers else 0.0
    )
    loader["tokens_per_worker_cpu_s"] = loader["tokens"] / max(loader["worker_cpu_seconds"], 1e-9)
    results["benchmark_peak_process_gib"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    markdown = report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown + "\n", encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + markdown + f"\n\nreport written to {args.out} and {args.out.with_suffix('.json')}")
    return 0 if results["loader_resume"]["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
