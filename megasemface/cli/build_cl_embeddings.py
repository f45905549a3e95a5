"""Builds the cross-lingual subword embedding table for CL-SemFace from token shards.

Example::

    python tools/build_cl_embeddings.py --shards shards/demo --spm-model spm/joint.model \\
        --out emb/cl-512 --dim 512 --epochs 5 --gold-dict corpus/dict/en-de.tsv --threads 8

Writes ``<out>.safetensors`` (tensor ``embeddings``, [vocab, dim]) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megasemface.embeddings.build import CLEmbeddingConfig, CLEmbeddingError, build_cl_embeddings
from megasemface.embeddings.skipgram import SkipGramConfig

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    sg = SkipGramConfig()
    cl = CLEmbeddingConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, required=True, help="shard directory (manifest)")
    parser.add_argument("--spm-model", type=Path, required=True, help="SentencePiece .model")
    parser.add_argument("--out", type=Path, required=True, help="output prefix")
    parser.add_argument("--dim", type=int, default=sg.dim, help="embedding size (= d_model)")
    parser.add_argument("--epochs", type=int, default=sg.epochs)
    parser.add_argument("--window", type=int, default=sg.window)
    parser.add_argument("--negatives", type=int, default=sg.negatives)
    parser.add_argument("--lr", type=float, default=sg.lr)
    parser.add_argument("--batch-size", type=int, default=sg.batch_size)
    parser.add_argument("--min-count", type=int, default=sg.min_count)
    parser.add_argument("--seed", type=int, default=sg.seed)
    parser.add_argument("--lang", action="append", default=[], help="language (repeat)")
    parser.add_argument("--pivot", default=None, help="language mapped onto (default: first)")
    parser.add_argument("--seed-min-count", type=int, default=cl.seed_min_count)
    parser.add_argument("--dict-min-count", type=int, default=cl.dict_min_count)
    parser.add_argument("--max-iterations", type=int, default=cl.max_iterations)
    parser.add_argument("--direction", choices=("mutual", "forward", "union"), default=cl.direction)
    parser.add_argument("--max-tokens-per-lang", type=int, default=None)
    parser.add_argument("--gold-dict", type=Path, default=None, help="src<TAB>tgt word pairs")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = CLEmbeddingConfig(
            skipgram=SkipGramConfig(
                dim=args.dim,
                window=args.window,
                negatives=args.negatives,
                epochs=args.epochs,
                lr=args.lr,
                batch_size=args.batch_size,
                min_count=args.min_count,
                seed=args.seed,
            ),
            languages=tuple(args.lang),
            pivot=args.pivot,
            seed_min_count=args.seed_min_count,
            dict_min_count=args.dict_min_count,
            max_iterations=args.max_iterations,
            direction=args.direction,
            max_tokens_per_lang=args.max_tokens_per_lang,
            threads=args.threads,
        )
        report = build_cl_embeddings(
            args.shards, args.spm_model, args.out, config, gold_dict=args.gold_dict
        )
    except (CLEmbeddingError, ValueError, FileNotFoundError, OSError) as exc:
        print(f"build_cl_embeddings: error: {exc}", file=sys.stderr)
        return 2
    summary = {k: report[k] for k in ("table", "vocab_size", "dim", "ids", "mapping")}
    for key in ("gold", "bli_before", "bli_after"):
        if key in report:
            summary[key] = report[key]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
