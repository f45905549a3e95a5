"""Exports a translation model directory for Hugging Face transformers or CTranslate2.

Examples::

    python tools/export.py huggingface --model-dir runs/demo/ft-cl/best --src-lang en \\
        --tgt-lang de --out exports/cl-en-de-hf
    python tools/export.py ctranslate2 --model-dir runs/demo/ft-cl/best --src-lang en \\
        --tgt-lang de --out exports/cl-en-de-ct2-int8 --quantization int8

One export is one direction (megasemface's language embeddings are folded into the weights).
The directory gets the model, its tokenizer (``spm.model``; for transformers also
``tokenizer.json``) and a model card (README.md) with the model's shape, lineage, scores and
data. Prints a JSON summary. docs/export.md shows how to use the exports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megasemface.cli.parsing import command_parser, parse_or_status
from megasemface.export.ct2 import QUANTIZATIONS
from megasemface.export.run import export_ctranslate2, export_huggingface
from megasemface.export.source import ExportError
from megasemface.models.model_dir import ModelDirError

_PROG = "export"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-command per format."""
    parser = command_parser(__doc__, prog=_PROG)
    formats = parser.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("huggingface", help="an mBART directory for transformers")
    ct2 = formats.add_parser("ctranslate2", help="a ctranslate2.Translator model")
    for sub in (hf, ct2):
        sub.add_argument("--model-dir", type=Path, required=True, help="a seq2seq model directory")
        sub.add_argument("--src-lang", required=True, help="source language, e.g. en")
        sub.add_argument("--tgt-lang", required=True, help="target language, e.g. de")
        sub.add_argument("--out", type=Path, required=True, help="the export directory")
        sub.add_argument(
            "--scores",
            type=Path,
            help="test scores JSON for the model card (default: test-scores.json beside "
            "the model directory, as the pipeline writes it)",
        )
        sub.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ct2.add_argument("--quantization", choices=QUANTIZATIONS, default="float32")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    args = parse_or_status(build_parser(), argv)
    if isinstance(args, int):
        return args
    common = {"scores": args.scores, "overwrite": args.overwrite}
    try:
        if args.scores is not None and not args.scores.is_file():
            raise FileNotFoundError(f"--scores {args.scores} does not exist")
        if args.format == "huggingface":
            summary = export_huggingface(
                args.model_dir, args.src_lang, args.tgt_lang, args.out, **common
            )
        else:
            summary = export_ctranslate2(
                args.model_dir,
                args.src_lang,
                args.tgt_lang,
                args.out,
                quantization=args.quantization,
                **common,
            )
    except ImportError as exc:
        print(
            f"{_PROG}: error: {exc.name or exc} is not installed; pip install "
            "'megasemface[export]'",
            file=sys.stderr,
        )
        return 2
    except (ModelDirError, ExportError, FileNotFoundError, ValueError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
