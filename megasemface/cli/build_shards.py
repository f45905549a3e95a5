"""Builds webdataset token shards from monolingual and parallel text files.

Examples::

    python tools/build_shards.py --spm-model spm/joint.model --out shards/demo \\
        --input en:corpus/mono.en.txt.gz --input de:corpus/mono.de.txt.zst --jobs 8 --dedup
    python tools/build_shards.py --spm-model spm/joint.model --out shards/en-de \\
        --parallel en-de:corpus/train.en,corpus/train.de --jobs 8 --dedup

``--input`` and ``--parallel`` may be mixed in one build: each pair becomes one more entry
of the manifest, named after the pair, whose sentences are pairs
(``megasemface.data.loading.pairs``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megasemface.cli.parsing import command_parser
from megasemface.data.shards.shard_build_config import ShardBuildConfig, ShardBuildError
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.textio import parse_lang_path, parse_parallel


def build_parser() -> argparse.ArgumentParser:
    defaults = ShardBuildConfig()
    parser = command_parser(__doc__)
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="LANG:PATH",
        help="a monolingual corpus (plain, .gz, .bz2, .xz or .zst); repeat per file",
    )
    parser.add_argument(
        "--parallel",
        action="append",
        default=[],
        metavar="SRC-TGT:SRC_PATH,TGT_PATH",
        help="a parallel corpus: two line-aligned files, read in lockstep; repeat per file "
        "pair. Pairs are kept together (dropped whole, de-duplicated as pairs)",
    )
    parser.add_argument("--spm-model", type=Path, required=True, help="SentencePiece .model")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--jobs", type=int, default=defaults.jobs, help="encoding processes")
    parser.add_argument("--dedup", action="store_true", help="drop exact duplicate lines")
    parser.add_argument("--max-chars", type=int, default=defaults.max_chars)
    parser.add_argument(
        "--max-sentence-tokens",
        type=int,
        default=defaults.max_tokens,
        help="longer sentences, or pairs with a longer side, are dropped",
    )
    # The former name, which train.py's batch size shares: accepted with a warning.
    parser.add_argument("--max-tokens", type=int, dest="old_max_tokens", help=argparse.SUPPRESS)
    parser.add_argument("--tokens-per-sample", type=int, default=defaults.tokens_per_sample)
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace shards (or an unfinished build) made from other inputs or options",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.input and not args.parallel:
        parser.error("give at least one --input or --parallel corpus")
    if args.old_max_tokens is not None:
        print(
            "build_shards: warning: --max-tokens is now --max-sentence-tokens (train.py's "
            "--max-tokens is a batch size); the old name will go",
            file=sys.stderr,
        )
        args.max_sentence_tokens = args.old_max_tokens
    try:
        corpora = parse_lang_path(args.input) + parse_parallel(args.parallel)
        config = ShardBuildConfig(
            max_chars=args.max_chars,
            max_tokens=args.max_sentence_tokens,
            dedup=args.dedup,
            tokens_per_sample=args.tokens_per_sample,
            samples_per_shard=args.samples_per_shard,
            jobs=args.jobs,
        )
        manifest = build_shards(
            corpora,
            args.spm_model,
            args.out,
            config,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except (ShardBuildError, ValueError, OSError) as exc:  # OSError: e.g. --out not writable
        print(f"build_shards: error: {exc}", file=sys.stderr)
        return 2
    if manifest.get("already_built"):
        print(f"{args.out}: already built with these inputs and options; nothing to do")
    totals = manifest["totals"]
    # A pair's row counts pairs (lines of either file) and the tokens of both sides.
    names = {k: f"{k} (pairs)" if "pair" in v else k for k, v in manifest["languages"].items()}
    width = max(8, *(len(name) + 2 for name in names.values()))
    header = f"{'lang':<{width}}{'lines':>12}{'sentences':>12}{'tokens':>14}{'shards':>8}"
    print(f"{header}  dropped")
    for lang, info in manifest["languages"].items():
        dropped = ", ".join(f"{k}={v}" for k, v in info["filtered"].items() if v) or "none"
        print(
            f"{names[lang]:<{width}}{info['lines']:>12,}{info['sentences']:>12,}"
            f"{info['tokens']:>14,}{info['shards']:>8}  {dropped}"
        )
    print(
        f"total: {totals['sentences']:,} sentences, {totals['tokens']:,} tokens, "
        f"{totals['bytes_per_token']:.3f} bytes/token, manifest {args.out / 'manifest.json'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
