"""Cross-lingual embedding benchmark: the demo build, and each phase at the paper's scale.

1. **Demo build**: the README's command (dim 64, 10 epochs, 8,000-piece joint model) on the
   real demo corpus, with the identical and with the unsupervised initialisation: time and
   peak RSS of each phase (from the build's report), and bilingual lexicon induction
   precision@1/@5 before and after mapping against the corpus' gold dictionary.
2. **Paper scale**: V = 60,000 ids at d = 1,024 on synthetic vectors and ids (time and
   memory depend on the shapes, not on what the vectors mean). Each phase runs in a fresh
   process, so that its peak RSS is its own; the RSS of an idle process with torch loaded
   (the floor) is printed with them. Each figure stands beside its limit:

   - skip-gram: tokens/s of the default backend on one thread, one epoch over 2M Zipf ids
     (the sentence file included); memory beside the library's ``8 V d`` bytes;
   - mapping: normalisation, the identical seed and self-learning (Procrustes + CSLS
     dictionary induction over the 20,000 most frequent ids, blocks of 2,048 rows), timed
     per iteration; the unsupervised initialisation on the 4,000 most frequent ids; memory
     beside what a V x V float32 similarity matrix would take (14.4 GB);
   - merge: the [V, d] table from the mapped spaces.

Run: ``python benchmarks/bench_embeddings.py [--vocab 60000] [--dim 1024] [--iterations 1]
[--demo-epochs 10] [--tokens 2000000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.data.demo.demo_corpus import DEFAULT_LOCALE_DIR, build_demo_corpus
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path
from megasemface.embeddings import CLEmbeddingConfig, SkipGramConfig, build_cl_embeddings
from megasemface.embeddings.mapping import normalize, unsupervised_seed
from megasemface.embeddings.skipgram import train_skipgram
from megasemface.embeddings.table import map_language, merge_table

GB = 1e9


def _peak_rss_bytes() -> float:
    """Peak resident size of this process since start or the last :func:`_reset_peak`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux


def _reset_peak() -> None:
    """Restarts the peak RSS from the current RSS (Linux: "5" to clear_refs), so that a
    phase's peak does not include the making of its synthetic inputs."""
    # Where it cannot, the peak also counts the making of the inputs: an upper bound.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _child(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...], threads: int) -> Any:
    torch.set_num_threads(threads)
    result = fn(*args)
    result["peak_rss"] = _peak_rss_bytes()
    return result


def _in_fresh_process(
    fn: Callable[..., dict[str, Any]], *args: Any, threads: int
) -> dict[str, Any]:
    """``fn(*args)`` in a new spawned process; its result plus that process's peak RSS."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_child, fn, args, threads).result()


# --- part 1: the demo build --------------------------------------------------------------


def _demo_build(locale_dir: Path, work: Path, init: str, epochs: int) -> dict[str, Any]:
    corpus = work / "corpus"
    if not (corpus / "report.json").exists():
        build_demo_corpus(locale_dir, ["de"], corpus)
    mono = parse_lang_path([f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")])
    model = work / "joint.model"
    if not model.exists():
        train_spm(mono, work / "joint", SpmTrainConfig(vocab_size=8000, num_threads=2, seed=1))
        build_shards(mono, model, work / "shards", ShardBuildConfig(jobs=1))
    # The README's command: --dim 64 --epochs 10, everything else at its default.
    config = CLEmbeddingConfig(skipgram=SkipGramConfig(dim=64, epochs=epochs), init=init)
    return build_cl_embeddings(
        work / "shards",
        model,
        work / f"cl-{init}",
        config,
        gold_dict=corpus / "dict" / "en-de.tsv",
    )


# --- part 2: paper scale -----------------------------------------------------------------


def _floor() -> dict[str, Any]:
    return {}


def _skipgram(vocab: int, dim: int, tokens: int) -> dict[str, Any]:
    """One epoch of the default backend on one thread over ``tokens`` Zipf(1) ids in
    sentences of 30 (frequency, not meaning, sets the work)."""
    rng = np.random.default_rng(0)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    ids = np.searchsorted(cdf, rng.random(tokens) * cdf[-1], side="right").astype(np.int32)
    offsets = np.arange(0, tokens + 1, 30)
    offsets[-1] = tokens
    config = SkipGramConfig(dim=dim, epochs=1, threads=1)
    _reset_peak()
    result = train_skipgram(ids, offsets, vocab, config)
    return {
        "tokens_per_s": result.tokens / result.seconds,
        "seconds": result.seconds,
        "file_seconds": result.file_seconds,
        "trained": int(result.trained.sum()),
        "backend": config.backend,
    }


def _spaces(vocab: int, dim: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Two raw spaces, the second a rotated noisy copy of the first, and Zipf counts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(vocab, dim, generator=gen) * torch.linspace(2.0, 0.5, dim)
    rotation, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen))
    z = x @ rotation
    # Noise at which the unsupervised initialisation finds about half its pairs.
    z += 0.2 * torch.randn(vocab, dim, generator=gen)
    counts = (1e9 / np.arange(1, vocab + 1)).astype(np.int64)
    return {"en": x, "de": z}, {"en": counts, "de": counts}


def _mapping(vocab: int, dim: int, iterations: int) -> dict[str, Any]:
    raw, counts = _spaces(vocab, dim)
    trained = {lang: c >= 3 for lang, c in counts.items()}
    _reset_peak()
    started = time.perf_counter()
    spaces = {lang: normalize(v) for lang, v in raw.items()}
    del raw
    normalised = time.perf_counter()
    config = CLEmbeddingConfig(skipgram=SkipGramConfig(dim=dim), max_iterations=iterations)
    # Synthetic ids: no piece text, so none is a numeral (the identical seed reads none).
    digits = np.zeros(vocab, dtype=bool)
    matrix, entry = map_language("en", "de", spaces, counts, trained, config, digits=digits)
    mapped = time.perf_counter()
    spaces["en"] = spaces["en"] @ matrix
    applied = time.perf_counter()
    return {
        "normalize_s": normalised - started,
        "map_s": mapped - normalised,
        "apply_s": applied - mapped,
        "iterations": entry["iterations"],
        "induction_rows": entry["induction_rows"][0],
        "seed": entry["seed_dictionary"],
    }


def _unsupervised(vocab: int, dim: int, init_vocab: int) -> dict[str, Any]:
    raw, _ = _spaces(vocab, dim)
    # Frequency order is id order here, so the most frequent ids are the first rows.
    x, z = normalize(raw["en"][:init_vocab]), normalize(raw["de"][:init_vocab])
    del raw
    _reset_peak()
    started = time.perf_counter()
    seed = unsupervised_seed(x, z, block_size=2048)
    seconds = time.perf_counter() - started
    right = float((seed[:, 0] == seed[:, 1]).float().mean())
    return {"seconds": seconds, "pairs": int(seed.shape[0]), "right": right}


def _merge(vocab: int, dim: int) -> dict[str, Any]:
    raw, counts = _spaces(vocab, dim)
    trained = {lang: c >= 3 for lang, c in counts.items()}
    config = CLEmbeddingConfig(skipgram=SkipGramConfig(dim=dim))
    _reset_peak()
    started = time.perf_counter()
    table, _ = merge_table(["de", "en"], raw, counts, trained, config)
    return {"seconds": time.perf_counter() - started, "rows": int(table.shape[0])}


def run(
    locale_dir: Path,
    vocab: int = 60_000,
    dim: int = 1024,
    iterations: int = 1,
    threads: int | None = None,
    demo_epochs: int = 10,
    tokens: int = 2_000_000,
) -> dict[str, Any]:
    threads = threads or torch.get_num_threads()
    results: dict[str, Any] = {
        "vocab": vocab,
        "dim": dim,
        "threads": threads,
        "demo_epochs": demo_epochs,
        "tokens": tokens,
    }
    with tempfile.TemporaryDirectory(prefix="bench-emb-") as tmp:
        for init in ("identical", "unsupervised"):
            results[f"demo_{init}"] = _in_fresh_process(
                _demo_build, locale_dir, Path(tmp), init, demo_epochs, threads=threads
            )
    results["floor"] = _in_fresh_process(_floor, threads=threads)
    results["skipgram"] = _in_fresh_process(_skipgram, vocab, dim, tokens, threads=1)
    results["mapping"] = _in_fresh_process(_mapping, vocab, dim, iterations, threads=threads)
    results["unsupervised"] = _in_fresh_process(_unsupervised, vocab, dim, 4000, threads=threads)
    results["merge"] = _in_fresh_process(_merge, vocab, dim, threads=threads)
    return results


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def report(r: dict[str, Any]) -> str:
    epochs = r["demo_epochs"]
    rows = [
        f"| demo build (README command, {epochs} epochs) | identical init | unsupervised init |"
    ]
    rows.append("|---|---|---|")
    demo_i, demo_u = r["demo_identical"], r["demo_unsupervised"]
    phases = [p for p in demo_i["phases"] if p in demo_u["phases"]]
    for phase in phases:
        cells = [
            f"{d['phases'][phase]['seconds']:.1f} s, peak {d['phases'][phase]['peak_rss_mib']:,.0f}"
            " MiB"
            for d in (demo_i, demo_u)
        ]
        rows.append(f"| {phase} | {cells[0]} | {cells[1]} |")
    for key in ("bli_before", "bli_after"):
        cells = [f"p@1 {d[key]['p@1']:.3f}, p@5 {d[key]['p@5']:.3f}" for d in (demo_i, demo_u)]
        rows.append(f"| {key} ({demo_i[key]['queries']} queries) | {cells[0]} | {cells[1]} |")
    cells = [f"{d['seconds']:.1f} s, peak {d['peak_rss_mib']:,.0f} MiB" for d in (demo_i, demo_u)]
    rows.append(f"| whole build | {cells[0]} | {cells[1]} |")

    v, d = r["vocab"], r["dim"]
    floor = r["floor"]["peak_rss"]
    sg, mapping = r["skipgram"], r["mapping"]
    n = mapping["induction_rows"]
    vxv = 4.0 * v * v
    per_iteration = mapping["map_s"] / max(mapping["iterations"], 1)
    rows += [
        "",
        f"Paper scale: V = {v:,} ids, d = {d:,}, {r['threads']} threads; peak RSS of each "
        f"phase's own process (an idle one: {_gb(floor)}).",
        "",
        "| phase | measured | limit or peer |",
        "|---|---|---|",
        f"| skip-gram ({sg['backend']}, 1 epoch of {r['tokens']:,} Zipf ids, 1 thread) | "
        f"{sg['tokens_per_s']:,.0f} tokens/s ({sg['file_seconds']:.1f} s of "
        f"{sg['seconds']:.1f} s writing the sentence file), peak {_gb(sg['peak_rss'])} | "
        f"two [V, d] float32 matrices: 8 V d = {_gb(8.0 * v * d)} |",
        f"| normalise 2 spaces | {mapping['normalize_s']:.1f} s | |",
        f"| self-learning on {n:,} ids a language, {mapping['iterations']} iteration(s), "
        f"seed {mapping['seed']:,} pairs | {mapping['map_s']:.1f} s "
        f"({per_iteration:.1f} s per iteration), peak {_gb(mapping['peak_rss'])} | "
        f"V x V float32: {_gb(vxv)}; inputs 2 V d float32: {_gb(8.0 * v * d)} |",
        f"| apply the map to {v:,} rows | {mapping['apply_s']:.2f} s | |",
        f"| unsupervised initialisation, 4,000 ids | {r['unsupervised']['seconds']:.1f} s, "
        f"peak {_gb(r['unsupervised']['peak_rss'])}, {r['unsupervised']['right']:.0%} of "
        f"{r['unsupervised']['pairs']:,} pairs right | two 4,000^2 float32: "
        f"{_gb(2 * 4.0 * 4000**2)} |",
        f"| merge into the [V, d] table | {r['merge']['seconds']:.2f} s, peak "
        f"{_gb(r['merge']['peak_rss'])} | 2 V d float32 + table: {_gb(12.0 * v * d)} |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=60_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=1, help="self-learning iterations")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--demo-epochs", type=int, default=10, help="skip-gram epochs of the demo build"
    )
    parser.add_argument(
        "--tokens", type=int, default=2_000_000, help="Zipf ids of the paper-scale skip-gram"
    )
    parser.add_argument("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("vocab", "dim", "demo_epochs", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    results = run(
        args.locale_dir,
        args.vocab,
        args.dim,
        args.iterations,
        args.threads,
        demo_epochs=args.demo_epochs,
        tokens=args.tokens,
    )
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
