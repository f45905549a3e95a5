"""What every command does with its command line before it runs."""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from typing import Any

from megasemface.command_line import CommandParser, unknown_arguments_message

__all__ = [
    "CommandParser",
    "add_score_logging_arguments",
    "check_score_logging_run",
    "command_parser",
    "parse_or_status",
    "score_logging_error",
    "unknown_arguments_message",
]

_EXAMPLES = re.compile(r"^Examples?::\n\n((?:[ \t]+.*\n?|\n)+)", re.M)


def command_parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """A command's parser from its module docstring: the first paragraph describes it, the
    ``Example::`` block ends its ``--help``, as written (layout kept)."""
    text = doc or ""
    match = _EXAMPLES.search(text)
    if match:
        kwargs.setdefault(
            "epilog",
            "examples:\n" + textwrap.indent(textwrap.dedent(match.group(1)).strip("\n"), "  "),
        )
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return CommandParser(description=text.split("\n\n")[0], **kwargs)


def parse_or_status(parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """The parsed arguments, or the exit status when argparse stopped: 0 after ``--help``, 2
    after a usage error it has already printed (a bad ``MEGASEMFACE_CPU_GEMM`` is one).
    Commands return it instead of exiting, so they can be called as functions."""
    try:
        args = parser.parse_args(argv)
        # Read by the first matrix product, deep in a run: checked here instead (and torch
        # imported for it only when the variable is set).
        if "MEGASEMFACE_CPU_GEMM" in os.environ:
            from megasemface.nn import cpu_gemm

            try:
                cpu_gemm.check_setting()
            except ValueError as exc:
                parser.error(str(exc))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return args


def add_score_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``, ``--run-id`` and ``--metric-prefix``: log scores to an MLflow run."""
    parser.add_argument("--tracking-uri", help="MLflow tracking URI to log the metrics to")
    parser.add_argument("--run-id", help="the MLflow run to log the metrics to")
    parser.add_argument(
        "--metric-prefix", default="", help="prefix of the MLflow metric names, e.g. test/"
    )


def score_logging_error(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: str
) -> bool:
    """Prints an error line when only one of ``--tracking-uri`` and ``--run-id`` is given;
    returns whether it did."""
    if (args.tracking_uri is None) == (args.run_id is None):
        return False
    print(f"{command}: error: --tracking-uri and --run-id go together", file=sys.stderr)
    return True


def check_score_logging_run(args: argparse.Namespace) -> None:
    """Checks, before any scoring, that ``--tracking-uri`` is an existing MLflow store and
    ``--run-id`` a run in it; resolves ``args.tracking_uri`` in place (a path to an mlflow.db
    or to the run directory holding one becomes a URI).

    Raises:
        ValueError: a store that does not exist (MLflow would create an empty one) or is not
            a database, or a run it does not hold.
    """
    if args.tracking_uri is None:
        return
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from megasemface.tracking.compare import resolve_tracking_uri

    args.tracking_uri = resolve_tracking_uri(args.tracking_uri)
    try:
        MlflowClient(args.tracking_uri).get_run(args.run_id)
    except MlflowException as exc:
        raise ValueError(
            f"--run-id {args.run_id}: {exc.message} in {args.tracking_uri}; pass a run of that "
            "store (tools/compare_runs.py lists them)"
        ) from None
