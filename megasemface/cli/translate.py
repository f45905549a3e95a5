"""Translates sentences (one per line) with a seq2seq model directory.

Example::

    python tools/translate.py --model-dir runs/ft/model --src-lang en --tgt-lang de \\
        --input test.en --output test.hyp.de --beam 5 --reference test.de --lowercase

Reads standard input and writes standard output unless --input/--output name files; writes
one translation per input line (an empty line gives an empty line). With --reference it
prints corpus BLEU and chrF with sacreBLEU's signatures (on standard error when the
translations go to standard output), and with --tracking-uri/--run-id logs them to that MLflow
run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from megasemface.cli.parsing import (
    add_score_logging_arguments,
    check_score_logging_run,
    command_parser,
    parse_or_status,
    score_logging_error,
)
from megasemface.data.text.lines import (
    TextFileError,
    check_writable,
    one_line,
    read_lines,
    write_lines,
)
from megasemface.evaluation.metrics import evaluate, log_to_mlflow
from megasemface.inference.search import SearchConfig
from megasemface.inference.translate import Translator
from megasemface.models.model_dir import ModelDirError
from megasemface.nn.cpu_speed import prepare_process


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; search defaults come from :class:`SearchConfig`."""
    defaults = SearchConfig()
    parser = command_parser(__doc__)
    parser.add_argument("--model-dir", required=True, help="a seq2seq model directory")
    parser.add_argument("--src-lang", required=True, help="source language code, e.g. en")
    parser.add_argument("--tgt-lang", required=True, help="target language code, e.g. de")
    parser.add_argument("--input", default="-", help="source sentences (default: stdin)")
    parser.add_argument("--output", default="-", help="translations (default: stdout)")
    parser.add_argument("--beam", type=int, default=5, help="beam size; 1 is greedy search")
    parser.add_argument(
        "--lenpen", type=float, default=defaults.lenpen, help="length penalty (fairseq's)"
    )
    parser.add_argument(
        "--max-len-a",
        type=float,
        default=defaults.max_len_a,
        help="at most max_len_a * source tokens + max_len_b tokens are generated",
    )
    parser.add_argument("--max-len-b", type=int, default=defaults.max_len_b)
    parser.add_argument(
        "--min-len",
        type=int,
        default=defaults.min_len,
        help="no output ends before min_len_a * source tokens + min_len tokens",
    )
    parser.add_argument("--min-len-a", type=float, default=defaults.min_len_a)
    parser.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=defaults.no_repeat_ngram,
        help="no n-gram of this size twice in an output (0: no limit)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=4096,
        help="source tokens per batch, padding included",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--reference", help="reference translations: print BLEU and chrF")
    parser.add_argument("--lowercase", action="store_true", help="case-insensitive metrics")
    add_score_logging_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parse_or_status(parser, argv)
    if isinstance(args, int):
        return args
    if score_logging_error(parser, args, "translate"):
        return 2
    if args.tracking_uri and not args.reference:
        print("translate: error: --tracking-uri needs --reference", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prepare_process()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    try:
        config = SearchConfig(
            beam=args.beam,
            lenpen=args.lenpen,
            max_len_a=args.max_len_a,
            max_len_b=args.max_len_b,
            min_len=args.min_len,
            min_len_a=args.min_len_a,
            no_repeat_ngram=args.no_repeat_ngram_size,
        )
        check_writable(args.output)
        check_score_logging_run(args)
        # Model and languages first: a mistake there shows before a long input is read.
        translator = Translator.from_model_dir(args.model_dir, device)
        translator.language_index(args.src_lang)
        translator.language_index(args.tgt_lang)
        sources = read_lines(args.input)
        if not sources:
            where = "standard input" if args.input == "-" else args.input
            print(f"translate: warning: {where} has no line to translate", file=sys.stderr)
        references = read_lines(args.reference) if args.reference else None
        if references is not None and len(references) != len(sources):
            raise ValueError(
                f"{args.reference} has {len(references)} lines but {args.input} has "
                f"{len(sources)}: the reference must be line-aligned with the input"
            )
        translations = translator.translate(
            sources,
            src_lang=args.src_lang,
            tgt_lang=args.tgt_lang,
            config=config,
            batch_tokens=args.batch_tokens,
        )
    except (ModelDirError, TextFileError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"translate: error: {exc}", file=sys.stderr)
        return 2
    # Scored as written: one line each.
    translations = [one_line(t) for t in translations]
    try:
        write_lines(args.output, translations)
    except OSError as exc:  # e.g. a full disk
        print(f"translate: error: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    report = sys.stderr if args.output == "-" else sys.stdout
    print(
        f"translated {len(sources):,} sentences in {seconds:.1f} s "
        f"({len(sources) / max(seconds, 1e-9):,.1f} sentences/s, beam {config.beam}, {device})",
        file=sys.stderr,
    )
    if references is not None:
        result = evaluate(
            translations,
            references,
            lowercase=args.lowercase,
            hypotheses_name="translations",
            references_name=args.reference,
        )
        print(result.format(), file=report)
        if args.tracking_uri:
            log_to_mlflow(
                result,
                tracking_uri=args.tracking_uri,
                run_id=args.run_id,
                prefix=args.metric_prefix,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
