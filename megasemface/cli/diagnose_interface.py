"""Diagnoses a SemFace interface: code usage, encoder-interface cosine, what the pre-trained
cross-attention transfers, how translated words share codes (the paper's Fig. 5), and
whether the connected model reads a translation before any fine-tuning.

Examples::

    python tools/diagnose_interface.py --checkpoint runs/vq-joint \\
        --text en:data/valid.en --text de:data/valid.de --dictionary data/dict/en-de.tsv \\
        --output runs/vq-joint/diagnostics.json --log-to-run runs/vq-joint
    python tools/diagnose_interface.py --checkpoint runs/vq-decoder --model-dir models/vq-semface \\
        --text en:data/valid.en --measure nll
    python tools/diagnose_interface.py --checkpoint runs/cl-joint/checkpoints/step-00000400 \\
        --text en:data/valid.en --text de:data/valid.de --measure cosine --measure nll
    python tools/diagnose_interface.py --model-dir models/mbart \\
        --text en:data/valid.en --text de:data/valid.de --translations en-de

--checkpoint is an encoder, decoder or joint stage (a run directory: its newest complete
checkpoint; a checkpoint directory; or a pretraining model directory); --model-dir a
connected seq2seq model directory, whose encoder's output is the "encoder" memory of the NLL.
--translations names two texts that translate each other line by line: the decoder's NLL of
each sentence with the encoder's output for its translation, for an unrelated sentence of
the same language and for zeros, in both directions, and with --model-dir the zero-shot
greedy BLEU; any connected model (mBART's, XLM's) can be measured this way.
Prints a table (a column per language) and, with --output, writes every figure as JSON; with
--log-to-run, logs them as diag_* metrics at the checkpoint's step to the MLflow run the
checkpoint recorded, in the store given (a tracking URI, an mlflow.db, or the run directory
holding one). Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from megasemface.cli.measuring import (
    INPUT_ERRORS,
    add_output_arguments,
    checkpoint_run,
    input_error,
    parse_texts,
    report,
)
from megasemface.cli.parsing import CommandParser
from megasemface.evaluation.diagnostics import (
    MEASURES,
    DiagnosticsConfig,
    diagnose_interface,
    load_models,
    log_to_run,
)
from megasemface.nn.cpu_speed import prepare_process

PROG = "diagnose_interface"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults come from :class:`DiagnosticsConfig`."""
    defaults = {f.name: f.default for f in dataclasses.fields(DiagnosticsConfig)}
    parser = CommandParser(
        prog=PROG,
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Examples:\n\n" + (__doc__ or "").split("::\n\n")[1].split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", type=Path, help="an encoder, decoder or joint stage")
    parser.add_argument("--model-dir", type=Path, help="a connected seq2seq model directory")
    parser.add_argument(
        "--spm-model", type=Path, help="SentencePiece model (default: the one the run recorded)"
    )
    parser.add_argument(
        "--text",
        action="append",
        required=True,
        metavar="LANG:PATH",
        help="sentences of one language, one per line (repeat per language)",
    )
    parser.add_argument("--dictionary", type=Path, help="gold dictionary, source<TAB>target words")
    parser.add_argument(
        "--dictionary-langs", metavar="SRC-TGT", help="its languages (default: from its name)"
    )
    parser.add_argument(
        "--translations",
        metavar="SRC-TGT",
        help="two --text languages whose files are line-aligned translations: "
        "measure whether the connected model reads a translation",
    )
    parser.add_argument(
        "--measure",
        action="append",
        choices=MEASURES,
        help="compute only this (repeatable; default: all the sources allow)",
    )
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=defaults["max_sentences"],
        help="first non-blank lines read per language; 0: all",
    )
    parser.add_argument("--batch-tokens", type=int, default=defaults["batch_tokens"])
    parser.add_argument(
        "--top-k", type=int, default=defaults["top_k"], help="k of the code overlap"
    )
    parser.add_argument(
        "--max-occurrences",
        type=int,
        default=defaults["max_occurrences"],
        help="occurrences averaged per dictionary word",
    )
    add_output_arguments(parser, "diag_*")
    return parser


def _language_pair(value: str | None, option: str) -> tuple[str, str] | None:
    if not value:
        return None
    source, sep, target = value.partition("-")
    if not sep or not source or not target:
        raise ValueError(f"{option} expects SRC-TGT, got {value!r}")
    return source, target


def _config(args: argparse.Namespace) -> DiagnosticsConfig:
    texts = parse_texts(args.text)
    langs = _language_pair(args.dictionary_langs, "--dictionary-langs")
    for name in ("checkpoint", "model_dir", "spm_model", "dictionary"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            raise FileNotFoundError(f"--{name.replace('_', '-')} {path} does not exist")
    return DiagnosticsConfig(
        checkpoint=args.checkpoint,
        model_dir=args.model_dir,
        spm_model=args.spm_model,
        texts=texts,
        dictionary=args.dictionary,
        dictionary_langs=langs,
        measures=tuple(args.measure) if args.measure else None,
        max_sentences=args.max_sentences,
        batch_tokens=args.batch_tokens,
        top_k=args.top_k,
        max_occurrences=args.max_occurrences,
        translations=_language_pair(args.translations, "--translations"),
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input, as argparse's own)."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    prepare_process()
    try:
        config = _config(args)
        models = load_models(config.checkpoint, config.model_dir, config.spm_model)
        target = None
        if args.log_to_run:
            source = config.checkpoint or "the model directory"
            target = checkpoint_run(args.log_to_run, models.mlflow_run_id, source)
        diagnostics = diagnose_interface(config, models)
    except INPUT_ERRORS as exc:  # the library's input errors
        return input_error(PROG, exc)
    report(diagnostics, args.output, target, log_to_run, "diag_*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
