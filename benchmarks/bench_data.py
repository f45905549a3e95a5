"""Data-path benchmark: shard building, shard size and loader throughput on real text.

Figures are printed beside the limit measured in the same run on the same machine:

- shard building, sentences/s per worker process, beside SentencePiece's own batch-encoding
  rate on one core (the limit: building also reads, cleans, hashes, packs and writes);
  goal >= 0.8 of the limit per worker;
- shard bytes per token with uint16 ids (goal <= 2.2);
- loader tokens/s (real tokens) and the real-token fraction of batches (goal >= 0.9).

Run: ``python benchmarks/bench_data.py [--copies 8] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece as spm

from megasemface.data.demo.demo_corpus import DEFAULT_LOCALE_DIR, build_demo_corpus
from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import Manifest
from megasemface.data.text.cleaning import DropReason, clean_line
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import iter_lines, parse_lang_path


def _clean_texts(corpus: Path) -> list[str]:
    texts = []
    for raw in iter_lines(corpus):
        reason, text = clean_line(raw, 2000)
        if reason == DropReason.KEPT:
            texts.append(text)
    return texts


def _encode_rate(args: tuple[bytes, list[str]]) -> float:
    model, texts = args
    processor = spm.SentencePieceProcessor(model_proto=model)
    started = time.perf_counter()
    processor.encode(texts, out_type=int, num_threads=1)
    return len(texts) / (time.perf_counter() - started)


def _spm_encode_rate(model: Path, texts: list[str], processes: int) -> float:
    """SentencePiece batch encoding, one thread per process, ``processes`` at once.

    Returns sentences/s per process. Measured with as many processes as the build has
    workers, because processes sharing a machine slow each other down (memory bandwidth,
    shared caches, SMT siblings): that is the fair limit.
    """
    share = len(texts) // processes
    tasks = [(model.read_bytes(), texts[i * share : (i + 1) * share]) for i in range(processes)]
    with mp.get_context("fork").Pool(processes) as pool:
        return statistics.mean(pool.map(_encode_rate, tasks))


def _build_rate(inputs: list[str], model: Path, out: Path, jobs: int) -> tuple[float, dict]:
    """Shard building sentences/s of one fresh build."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    manifest = build_shards(parse_lang_path(inputs), model, out, ShardBuildConfig(jobs=jobs))
    return manifest["totals"]["sentences"] / (time.perf_counter() - started), manifest


def _loader_rate(shards: Path, workers: int, seconds: float = 3.0) -> tuple[float, float]:
    source = ShardSource.from_manifest(Manifest.load(shards))
    config = LoaderConfig(max_tokens=8192, num_workers=workers)
    loader = ShardLoader(source, config, pad_id=3)
    stream = iter(loader)
    next(stream)  # worker start-up is not throughput
    start_tokens = loader.stats()["tokens"]
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        next(stream)
    elapsed = time.perf_counter() - started
    stats = loader.stats()
    return (stats["tokens"] - start_tokens) / elapsed, stats["tokens"] / stats["padded"]


def run(copies: int, locale_dir: Path, work: Path, repeats: int = 3) -> dict[str, float]:
    corpus = work / "corpus"
    if not (corpus / "report.json").exists():
        build_demo_corpus(locale_dir, ["de"], corpus)
    inputs = []
    for lang in ("en", "de"):
        text = (corpus / "mono" / f"{lang}.txt").read_bytes()
        big = work / f"{lang}.x{copies}.txt"
        big.write_bytes(text * copies)
        inputs.append(f"{lang}:{big}")
    prefix = work / "spm" / "joint"
    if not prefix.with_suffix(".model").exists():
        corpora = parse_lang_path(
            [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
        )
        train_spm(corpora, prefix, SpmTrainConfig(vocab_size=8000, num_threads=2))
    model = prefix.with_suffix(".model")

    texts = [t for spec in inputs for t in _clean_texts(Path(spec.partition(":")[2]))]
    results: dict[str, float] = {}
    for jobs in sorted({1, os.cpu_count() or 1}):
        # Limit and build alternate, and medians are compared, so that a noisy neighbour
        # slows both alike.
        limits, rates = [], []
        for _ in range(repeats):
            limits.append(_spm_encode_rate(model, texts, jobs))
            rate, manifest = _build_rate(inputs, model, work / f"shards-j{jobs}", jobs)
            rates.append(rate)
        limit, rate = statistics.median(limits), statistics.median(rates)
        results[f"spm_encode_j{jobs}_sentences_per_s"] = limit
        results[f"build_j{jobs}_sentences_per_s"] = rate
        results[f"build_j{jobs}_per_worker_ratio"] = rate / jobs / limit
    results["sentences"] = manifest["totals"]["sentences"]
    results["bytes_per_token"] = manifest["totals"]["bytes_per_token"]
    for workers in (0, 1):
        tokens_per_s, real = _loader_rate(work / "shards-j1", workers)
        results[f"loader_w{workers}_tokens_per_s"] = tokens_per_s
        results["real_token_fraction"] = real
    return results


def report(results: dict[str, float]) -> str:
    jobs = sorted({int(k.split("_j")[1].split("_")[0]) for k in results if k.startswith("build_j")})
    rows = ["| figure | measured | limit or goal |", "|---|---|---|"]
    for j in jobs:
        limit = results[f"spm_encode_j{j}_sentences_per_s"]
        rate = results[f"build_j{j}_sentences_per_s"]
        ratio = results[f"build_j{j}_per_worker_ratio"]
        rows.append(
            f"| shard building, --jobs {j} | {rate:,.0f} sent/s, {rate / j:,.0f} per worker "
            f"= {ratio:.2f} of the limit | limit: raw SentencePiece batch encoding, "
            f"{j} process(es) at once: {limit:,.0f} sent/s each; goal >= 0.80 |"
        )
    rows += [
        f"| shard size | {results['bytes_per_token']:.3f} bytes/token | <= 2.2 (uint16 ids) |",
        f"| loader, in-process | {results['loader_w0_tokens_per_s']:,.0f} tokens/s | "
        "well above training consumption |",
        f"| loader, 1 worker | {results['loader_w1_tokens_per_s']:,.0f} tokens/s | |",
        f"| real tokens in batches | {results['real_token_fraction']:.3f} | >= 0.90 |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=8, help="repeat the demo corpus")
    parser.add_argument("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        results = run(args.copies, args.locale_dir, Path(tmp))
    print(
        f"data path on {results['sentences']:,.0f} sentences of real text (demo corpus x "
        f"{args.copies}), {os.cpu_count()} cores\n"
    )
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
