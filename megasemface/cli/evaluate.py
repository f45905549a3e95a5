"""Scores translations against references: corpus BLEU and chrF with sacreBLEU.

Example::

    python tools/evaluate.py --hypotheses test.hyp.de --references test.de --lowercase \\
        --tracking-uri sqlite:///runs/ft/mlflow.db --run-id 0123abcd

Prints each score with sacreBLEU's signature; with --tracking-uri/--run-id also logs them as
metrics (and the signatures as tags) of that MLflow run.
"""

from __future__ import annotations

import argparse
import sys

from megasemface.cli.parsing import (
    add_score_logging_arguments,
    check_score_logging_run,
    command_parser,
    parse_or_status,
    score_logging_error,
)
from megasemface.data.text.lines import TextFileError, read_lines
from megasemface.evaluation.metrics import evaluate, log_to_mlflow


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(__doc__)
    parser.add_argument("--hypotheses", required=True, help="translations, one per line")
    parser.add_argument("--references", required=True, help="references, line-aligned")
    parser.add_argument("--lowercase", action="store_true", help="case-insensitive metrics")
    add_score_logging_arguments(parser)
    parser.add_argument("--step", type=int, help="MLflow step of the logged metrics")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parse_or_status(parser, argv)
    if isinstance(args, int):
        return args
    if score_logging_error(parser, args, "evaluate"):
        return 2
    try:
        check_score_logging_run(args)
        result = evaluate(
            read_lines(args.hypotheses),
            read_lines(args.references),
            lowercase=args.lowercase,
            hypotheses_name=args.hypotheses,
            references_name=args.references,
        )
    except (TextFileError, ValueError, FileNotFoundError) as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(result.format())
    if args.tracking_uri:
        log_to_mlflow(
            result,
            tracking_uri=args.tracking_uri,
            run_id=args.run_id,
            prefix=args.metric_prefix,
            step=args.step,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
