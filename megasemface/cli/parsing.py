"""What every command does with its command line before it runs."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["parse_or_status"]


def parse_or_status(parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """The parsed arguments, or the exit status when argparse stopped: 0 after ``--help``, 2
    after a usage error it has already printed. Commands return it instead of exiting, so
    they can be called as functions."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
