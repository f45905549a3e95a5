"""Trains one joint SentencePiece model over several monolingual corpora.

Example::

    python tools/train_spm.py --output spm/joint --vocab-size 60000 \\
        --input en:corpus/mono.en.txt.gz --input de:corpus/mono.de.txt.zst \\
        --input gu:corpus/mono.gu.txt.xz

writes spm/joint.model, spm/joint.vocab and spm/joint.json (the sampling report).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from megasemface.cli.parsing import command_parser, parse_or_status
from megasemface.data.text.spm_training import MODEL_TYPES, SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults come from :class:`SpmTrainConfig`."""
    defaults = SpmTrainConfig()
    parser = command_parser(__doc__)
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="LANG:PATH",
        help="a monolingual corpus (plain, .gz, .bz2, .xz or .zst); repeat per file. "
        "Language tags get ids in the order languages are first given",
    )
    parser.add_argument(
        "--output",
        type=Path,
        required=True,
        metavar="PREFIX",
        help="writes PREFIX.model, PREFIX.vocab and PREFIX.json",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=defaults.vocab_size, help="pieces in the model"
    )
    parser.add_argument("--model-type", choices=MODEL_TYPES, default=defaults.model_type)
    parser.add_argument(
        "--max-sentences-per-lang",
        type=int,
        default=defaults.max_sentences_per_lang,
        help="lines sampled (and held in memory) per language (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="language sampling temperature; 1 keeps raw proportions (default: %(default)s)",
    )
    parser.add_argument("--character-coverage", type=float, default=defaults.character_coverage)
    parser.add_argument(
        "--max-sentence-chars",
        type=int,
        default=defaults.max_sentence_chars,
        help="skip longer lines (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.num_threads,
        help="trainer threads and reading processes (default: %(default)s, the CPU count). "
        "The .model records it: reuse the same value to reproduce a model byte for byte",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress logging")
    return parser


def _print_report(report: dict[str, Any]) -> None:
    print(
        f"{'lang':<8}{'lines read':>14}{'usable':>14}{'sampled':>12}{'quota':>12}"
        f"{'raw share':>11}{'share':>9}"
    )
    for lang, info in report["per_language"].items():
        print(
            f"{lang:<8}{info['lines_read']:>14,}{info['lines_usable']:>14,}"
            f"{info['sampled']:>12,}{info['quota']:>12,}"
            f"{info['raw_share']:>11.2%}{info['share']:>9.2%}"
        )
        dropped = {
            "blank": info["dropped_empty"],
            "invalid UTF-8": info["dropped_invalid_utf8"],
            "too long": info["dropped_too_long"],
        }
        if any(dropped.values()):
            print(f"{'':<8}dropped: " + ", ".join(f"{k} {v:,}" for k, v in dropped.items() if v))
        if info.get("first_invalid_utf8"):
            print(f"{'':<8}first invalid UTF-8 line: {info['first_invalid_utf8']}")
    print(
        f"{report['model_type']} vocabulary of {report['vocab_size']:,} pieces trained on "
        f"{report['training_sentences']:,} sentences; sha256 {report['model_sha256']}"
    )
    for kind, path in report["files"].items():
        print(f"{kind:<7}{path}")


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parse_or_status(parser, argv)
    if isinstance(args, int):
        return args
    if not args.quiet:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    try:
        corpora = parse_lang_path(args.input)
        config = SpmTrainConfig(
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            max_sentences_per_lang=args.max_sentences_per_lang,
            temperature=args.temperature,
            seed=args.seed,
            num_threads=args.threads,
            max_sentence_chars=args.max_sentence_chars,
            verbose=not args.quiet,
        )
        report = train_spm(corpora, args.output, config)
    except (FileNotFoundError, ValueError) as exc:  # CorpusReadError is a ValueError
        print(f"train_spm: error: {exc}", file=sys.stderr)
        return 2
    _print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
