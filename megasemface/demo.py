"""The README's main command: megasemface's pipeline on the embedded real demo corpus.

Steps, each reused when its output is already there (and said so):

1. demo corpus from the system's gettext catalogs (``tools/make_demo_corpus.py``);
2. one joint SentencePiece model over the monolingual text (``tools/train_spm.py``);
3. webdataset token shards with a manifest (``tools/build_shards.py``);
4. the streaming loader over the shards: batches, padding, language mix, throughput.

Run ``python -m megasemface.demo --help`` for options; ``make demo`` runs it with defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from megasemface.data.demo_corpus import DEFAULT_LOCALE_DIR, DemoCorpusError, build_demo_corpus
from megasemface.data.loader import LoaderConfig, ShardLoader, ShardSource
from megasemface.data.shard_builder import ShardBuildConfig, ShardBuildError, build_shards
from megasemface.data.shard_format import Manifest
from megasemface.data.textio import parse_lang_path
from megasemface.data.tokenizer import SpmTrainConfig, Tokenizer, train_spm


def _step(number: int, title: str) -> None:
    print(f"\n== {number}. {title}", flush=True)


def _corpus(args: argparse.Namespace, langs: list[str]) -> Path:
    out = args.out / "corpus"
    files = [out / "mono" / f"{lang}.txt" for lang in ["en", *langs]]
    if (out / "report.json").exists() and all(f.exists() for f in files):
        print(f"reusing {out} (delete it to rebuild)")
        return out
    report = build_demo_corpus(args.locale_dir, langs, out)
    for pair, info in report["pairs"].items():
        sizes = ", ".join(f"{split} {n:,}" for split, n in info["split_sizes"].items())
        print(f"{pair} parallel pairs: {sizes} (split by program, no test text in training)")
    for lang, info in report["mono"].items():
        print(f"{lang} monolingual: {info['lines']:,} lines")
    print(f"wrote {out}")
    return out


def _spm(args: argparse.Namespace, corpus: Path, langs: list[str]) -> Path:
    prefix = args.out / "spm" / "joint"
    model = prefix.with_suffix(".model")
    all_langs = ["en", *langs]
    if model.exists() and set(Tokenizer.load(model).languages) == set(all_langs):
        print(f"reusing {model}")
        return model
    prefix.parent.mkdir(parents=True, exist_ok=True)
    corpora = parse_lang_path([f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in all_langs])
    config = SpmTrainConfig(vocab_size=args.vocab_size, seed=args.seed)
    started = time.perf_counter()
    train_spm(corpora, prefix, config)
    print(f"trained {model} ({args.vocab_size} pieces) in {time.perf_counter() - started:.1f}s")
    return model


def _shards(args: argparse.Namespace, corpus: Path, model: Path, langs: list[str]) -> Path:
    out = args.out / "shards"
    inputs = [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in ["en", *langs]]
    # Small samples and shards, so the demo's few hundred thousand tokens still make enough
    # shards for several ranks and workers.
    config = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8, jobs=args.jobs)
    # The demo owns its directory: shards from an older corpus or model are replaced.
    corpora = parse_lang_path(inputs)
    manifest = build_shards(corpora, model, out, config, overwrite=True, progress=True)
    if manifest.get("already_built"):
        print(f"reusing {out}")
    totals = manifest["totals"]
    print(
        f"{totals['shards']} shards, {totals['sentences']:,} sentences, "
        f"{totals['tokens']:,} tokens, {totals['bytes_per_token']:.2f} bytes/token "
        "(small samples for the demo; the default layout stays under 2.2)"
    )
    for lang, info in manifest["languages"].items():
        dropped = {k: v for k, v in info["filtered"].items() if v}
        print(f"  {lang}: {info['sentences']:,} sentences kept, dropped {dropped or 'none'}")
    return out


def _stream(args: argparse.Namespace, shards: Path, model: Path) -> None:
    tokenizer = Tokenizer.load(model)
    source = ShardSource.from_manifest(Manifest.load(shards))
    config = LoaderConfig(max_tokens=4096, max_len=128, num_workers=args.workers, seed=args.seed)
    loader = ShardLoader(source, config, pad_id=tokenizer.pad_id)
    started = time.perf_counter()
    langs: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for _, batch in zip(range(args.batches), loader, strict=False):
        langs[batch.lang] += 1
        if batch.lang not in examples:
            length = int(batch.lengths[0])
            examples[batch.lang] = tokenizer.decode(batch.tokens[0, :length].tolist())
    seconds = time.perf_counter() - started
    stats = loader.stats()
    print(
        f"{args.batches} batches in {seconds:.2f}s: {stats['tokens'] / seconds:,.0f} tokens/s, "
        f"{stats['tokens'] / max(stats['padded'], 1):.1%} real tokens (rest padding)"
    )
    print(f"batches per language: {dict(langs)}")
    for lang, text in examples.items():
        print(f"  {lang}: {text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo"), help="working directory")
    parser.add_argument("--pair", default="en-de", help="language pair, en-xx (default en-de)")
    parser.add_argument("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--jobs", type=int, default=2, help="shard encoding processes")
    parser.add_argument("--workers", type=int, default=1, help="loader worker processes")
    parser.add_argument("--batches", type=int, default=500, help="batches to stream")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source, _, target = args.pair.partition("-")
    if source != "en" or not target:
        parser.error(f"--pair must be en-xx (the catalogs translate from English), got {args.pair}")
    langs = [target]
    try:
        _step(1, f"demo corpus from gettext catalogs in {args.locale_dir}")
        corpus = _corpus(args, langs)
        _step(2, "joint SentencePiece model")
        model = _spm(args, corpus, langs)
        _step(3, "webdataset token shards")
        shards = _shards(args, corpus, model, langs)
        _step(4, "streaming loader")
        _stream(args, shards, model)
    except (DemoCorpusError, ShardBuildError, ValueError, FileNotFoundError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"\ndone: everything is under {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
