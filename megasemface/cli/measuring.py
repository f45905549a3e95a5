"""What the commands that measure a pre-training checkpoint on text share
(``tools/diagnose_interface.py``, ``tools/valid_mlm.py``): the ``--text`` files, the MLflow run
``--log-to-run`` names, and what they do with the figures once measured."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from safetensors import SafetensorError

__all__ = [
    "INPUT_ERRORS",
    "Figures",
    "add_output_arguments",
    "checkpoint_run",
    "input_error",
    "parse_texts",
    "report",
]

INPUT_ERRORS = (ValueError, OSError, KeyError, SafetensorError)
"""What the library raises for bad input: one line, status 2."""


class Figures(Protocol):
    """A measurement's result: a table to print, a dict to write."""

    def format_table(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def add_output_arguments(parser: argparse.ArgumentParser, metrics: str) -> None:
    """``--threads``, ``--output`` and ``--log-to-run``, which logs ``metrics``."""
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--log-to-run",
        metavar="TRACKING_URI",
        help=f"log {metrics} metrics to the checkpoint's MLflow run in this store",
    )


def parse_texts(items: Sequence[str]) -> dict[str, Path]:
    """``--text LANG:PATH`` options: language -> existing file.

    Raises:
        ValueError: an item that is not LANG:PATH, or a language given twice.
        FileNotFoundError: a file that does not exist.
    """
    texts: dict[str, Path] = {}
    for item in items:
        lang, sep, path = item.partition(":")
        if not sep or not lang or not path:
            raise ValueError(f"--text expects LANG:PATH, got {item!r}")
        if lang in texts:
            raise ValueError(f"--text gives {lang} twice")
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such file: {path}")
        texts[lang] = Path(path)
    return texts


def checkpoint_run(uri: str, run_id: str | None, checkpoint: object) -> tuple[str, str]:
    """``--log-to-run``: the resolved MLflow store and the run ``checkpoint`` recorded, both
    checked before the figures are shown.

    Raises:
        ValueError: the checkpoint records no run, or the store does not hold it.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from megasemface.tracking.compare import resolve_tracking_uri

    if not run_id:
        raise ValueError(
            f"{checkpoint} records no MLflow run (trained with --no-tracking?): nothing to log "
            "to; drop --log-to-run"
        )
    store = resolve_tracking_uri(uri)
    try:
        MlflowClient(store).get_run(run_id)
    except MlflowException:
        raise ValueError(
            f"the checkpoint's MLflow run {run_id} is not in {store}; pass the store the run "
            "logged to (by default <run>/mlflow.db)"
        ) from None
    return store, run_id


def input_error(prog: str, exc: BaseException) -> int:
    """Prints the one line of an :data:`INPUT_ERRORS` error; returns the exit status, 2."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def report(
    figures: Figures,
    output: Path | None,
    target: tuple[str, str] | None,
    log: Callable[..., int],
    metrics: str,
) -> None:
    """Prints the figures' table, writes them as JSON to ``output`` and, with a ``target``
    (store, run), logs them there with ``log(figures, tracking_uri=, run_id=)``, which
    returns how many ``metrics`` it logged."""
    print(figures.format_table())
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(figures.to_dict(), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {output}")
    if target is not None:
        count = log(figures, tracking_uri=target[0], run_id=target[1])
        print(f"logged {count} {metrics} metrics to MLflow run {target[1]} ({target[0]})")
