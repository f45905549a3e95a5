"""Builds the cross-lingual subword embedding table for CL-SemFace from token shards.

Example::

    python tools/build_cl_embeddings.py --shards shards/demo --spm-model demo/spm/joint.model \\
        --out demo/cl/en-de --dim 64 --gold-dict demo/corpus/dict/en-de.tsv

Writes ``<out>.safetensors`` (tensor ``embeddings``, [vocab, dim]) and ``<out>.json`` (the
report: sizes, iterations, ids never seen, time and memory per phase, BLI before and after
mapping). With ``--dictionary-out DIR/en-de.tsv`` it also writes a word dictionary induced
from the mapped spaces (CSLS nearest neighbours above ``--dictionary-min-score``), which
mRASP's random aligned substitution reads (``train.py --ras-dictionary``).

``--seed-parallel en-de:train.en,train.de`` seeds the mapping with piece pairs that co-occur
in translated sentences (the supervised setting's training pairs; never validation or test
pairs), ``--seed-dictionary en-de.tsv`` with a word list; BLI then leaves out the gold
queries the seed covers. Exit status 2 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megasemface.cli.parsing import command_parser
from megasemface.data.text.textio import parse_parallel
from megasemface.embeddings.build import (
    INITS,
    CLEmbeddingConfig,
    CLEmbeddingError,
    SeedParallel,
    build_cl_embeddings,
)
from megasemface.embeddings.mapping import DIRECTIONS
from megasemface.embeddings.skipgram import SKIPGRAM_BACKENDS, SkipGramConfig

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line; defaults come from SkipGramConfig and CLEmbeddingConfig."""
    sg = SkipGramConfig()
    cl = CLEmbeddingConfig()
    parser = command_parser(__doc__)
    parser.add_argument("--shards", type=Path, required=True, help="shard directory (manifest)")
    parser.add_argument("--spm-model", type=Path, required=True, help="SentencePiece .model")
    parser.add_argument("--out", type=Path, required=True, help="output prefix")
    train = parser.add_argument_group("skip-gram")
    train.add_argument("--dim", type=int, default=sg.dim, help="embedding size (= d_model)")
    train.add_argument("--epochs", type=int, default=sg.epochs)
    train.add_argument("--window", type=int, default=sg.window)
    train.add_argument("--negatives", type=int, default=sg.negatives)
    train.add_argument("--lr", type=float, default=sg.lr)
    train.add_argument("--min-count", type=int, default=sg.min_count)
    train.add_argument("--subsample", type=float, default=sg.subsample)
    train.add_argument("--seed", type=int, default=sg.seed)
    train.add_argument(
        "--skipgram-threads", type=int, default=sg.threads, help="worker threads of skip-gram"
    )
    train.add_argument(
        "--skipgram-backend",
        choices=tuple(SKIPGRAM_BACKENDS),
        default=sg.backend,
        help="the library that trains skip-gram (default: %(default)s)",
    )
    train.add_argument(
        "--skipgram-tmp-dir",
        default=sg.tmp_dir,
        help="folder of the temporary sentence file (about 5 bytes a token; default: the "
        "system's temporary folder)",
    )
    mapping = parser.add_argument_group("mapping")
    mapping.add_argument("--lang", action="append", default=[], help="language (repeat)")
    mapping.add_argument("--pivot", default=None, help="language mapped onto (default: first)")
    mapping.add_argument(
        "--init",
        choices=list(INITS),
        default=cl.init,
        help="initial dictionary: shared pieces, shared pieces holding a digit, or VecMap's "
        "unsupervised initialisation",
    )
    mapping.add_argument(
        "--seed-parallel",
        action="append",
        default=[],
        metavar="SRC-TGT:SRC_FILE,TGT_FILE",
        help="translated sentences whose co-occurring pieces seed the mapping (repeat)",
    )
    mapping.add_argument(
        "--seed-dictionary",
        type=Path,
        default=None,
        help="word pairs that seed the mapping, a file named <src>-<tgt>.tsv",
    )
    mapping.add_argument(
        "--seed-pair-min-count",
        type=int,
        default=cl.seed_pair_min_count,
        help="sentence pairs a seed piece pair must co-occur in (default: %(default)s)",
    )
    mapping.add_argument("--init-vocab", type=int, default=cl.init_vocab)
    mapping.add_argument("--seed-min-count", type=int, default=cl.seed_min_count)
    mapping.add_argument("--dict-min-count", type=int, default=cl.dict_min_count)
    mapping.add_argument("--induction-vocab", type=int, default=cl.induction_vocab)
    mapping.add_argument("--max-iterations", type=int, default=cl.max_iterations)
    mapping.add_argument("--direction", choices=DIRECTIONS, default=cl.direction)
    mapping.add_argument(
        "--stochastic",
        nargs=2,
        type=float,
        metavar=("KEEP_PROB", "INTERVAL"),
        default=None,
        help="stochastic dictionary induction: initial keep probability, doubling interval",
    )
    parser.add_argument(
        "--no-centre-languages",
        dest="centre_languages",
        action="store_false",
        help="keep each language's mean direction in the rows (default: taken out)",
    )
    parser.add_argument("--max-tokens-per-lang", type=int, default=None)
    parser.add_argument("--gold-dict", type=Path, default=None, help="src<TAB>tgt word pairs")
    parser.add_argument("--bli-min-count", type=int, default=cl.bli_min_count)
    ras = parser.add_argument_group("RAS dictionary")
    ras.add_argument(
        "--dictionary-out",
        type=Path,
        default=None,
        help="write the induced word dictionary here, named <src>-<tgt>.tsv",
    )
    ras.add_argument(
        "--dictionary-words",
        type=int,
        default=cl.dictionary_words,
        help="most frequent words of each language translated (default: %(default)s)",
    )
    ras.add_argument(
        "--dictionary-min-score",
        type=float,
        default=cl.dictionary_min_score,
        help="lowest CSLS score of a pair kept (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for the mapping (default: all)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the build; prints a JSON summary, or one error line and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        stochastic = None
        if args.stochastic is not None:
            stochastic = (args.stochastic[0], int(args.stochastic[1]))
        config = CLEmbeddingConfig(
            skipgram=SkipGramConfig(
                dim=args.dim,
                window=args.window,
                negatives=args.negatives,
                epochs=args.epochs,
                lr=args.lr,
                min_count=args.min_count,
                subsample=args.subsample,
                seed=args.seed,
                threads=args.skipgram_threads,
                backend=args.skipgram_backend,
                tmp_dir=args.skipgram_tmp_dir,
            ),
            languages=tuple(args.lang),
            pivot=args.pivot,
            init=args.init,
            init_vocab=args.init_vocab,
            seed_min_count=args.seed_min_count,
            seed_pair_min_count=args.seed_pair_min_count,
            dict_min_count=args.dict_min_count,
            induction_vocab=args.induction_vocab,
            max_iterations=args.max_iterations,
            direction=args.direction,
            stochastic=stochastic,
            bli_min_count=args.bli_min_count,
            max_tokens_per_lang=args.max_tokens_per_lang,
            centre_languages=args.centre_languages,
            threads=args.threads,
            dictionary_words=args.dictionary_words,
            dictionary_min_score=args.dictionary_min_score,
        )
        report = build_cl_embeddings(
            args.shards,
            args.spm_model,
            args.out,
            config,
            gold_dict=args.gold_dict,
            dictionary_out=args.dictionary_out,
            seed_parallel=[
                SeedParallel(spec.pair, tuple(zip(spec.paths, spec.target_paths, strict=True)))
                for spec in parse_parallel(args.seed_parallel)
            ],
            seed_dictionary=args.seed_dictionary,
        )
    except (CLEmbeddingError, ValueError, FileNotFoundError, OSError) as exc:
        print(f"build_cl_embeddings: error: {exc}", file=sys.stderr)
        return 2
    summary = {k: report[k] for k in ("table", "vocab_size", "dim", "ids", "mapping", "seconds")}
    for key in ("gold", "seeds", "bli_before", "bli_after", "dictionary"):
        if key in report:
            summary[key] = report[key]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
