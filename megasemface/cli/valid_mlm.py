"""The encoder MLM of a finished pre-training on validation text, per language and over all.

Examples::

    python tools/valid_mlm.py --checkpoint runs/lowres/runs/pretrain-xlm \\
        --text en:data/valid.en --text de:data/valid.de --max-sentences 3000
    python tools/valid_mlm.py --checkpoint runs/vq-joint --text en:data/valid.en \\
        --text de:data/valid.de --output runs/vq-joint/valid-mlm.json --log-to-run runs/vq-joint

--checkpoint is an encoder or joint stage (XLM's, CL-SemFace's, VQ-SemFace's pre-training): a
run directory (its newest complete checkpoint), a checkpoint directory, or a pretraining
model directory. The model is run in eval mode on the first --max-sentences lines of each
text, in batches of 32 sentences with the masks train.py's validation draws, so the figure is
the run's valid_enc_mlm for the same text and --valid-max-sentences. With --output, writes it
as JSON; with --log-to-run, logs it as final_valid_enc_mlm (and final_valid_enc_mlm_<lang>) at
the checkpoint's step to the MLflow run the checkpoint recorded, in the store given (a
tracking URI, an mlflow.db, or the run directory holding one). Bad input prints one line and
exits with status 2.
"""

from __future__ import annotations

import argparse
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
from megasemface.cli.parsing import command_parser, parse_or_status
from megasemface.evaluation.encoder_mlm import encoder_mlm, log_to_run
from megasemface.nn.cpu_speed import prepare_process
from megasemface.training.options import TrainConfig

PROG = "valid_mlm"


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(__doc__, prog=PROG)
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="an encoder or joint pre-training stage"
    )
    parser.add_argument(
        "--text",
        action="append",
        required=True,
        metavar="LANG:PATH",
        help="validation sentences of one language, one per line (repeat per language)",
    )
    parser.add_argument(
        "--spm-model", type=Path, help="SentencePiece model (default: the one the run recorded)"
    )
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=TrainConfig.valid_max_sentences,
        help="first lines read per language (default: train.py's --valid-max-sentences, "
        "%(default)s)",
    )
    add_output_arguments(parser, "final_valid_enc_mlm")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input, as argparse's own)."""
    args = parse_or_status(build_parser(), argv)
    if isinstance(args, int):
        return args
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    prepare_process()
    try:
        texts = parse_texts(args.text)
        for name in ("checkpoint", "spm_model"):
            path = getattr(args, name)
            if path is not None and not path.exists():
                raise FileNotFoundError(f"--{name.replace('_', '-')} {path} does not exist")
        result = encoder_mlm(
            args.checkpoint, texts, spm_model=args.spm_model, max_sentences=args.max_sentences
        )
        target = None
        if args.log_to_run:
            target = checkpoint_run(args.log_to_run, result.mlflow_run_id, args.checkpoint)
    except INPUT_ERRORS as exc:  # the library's input errors
        return input_error(PROG, exc)
    report(result, args.output, target, log_to_run, "final_valid_enc_mlm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
