"""Pre-training learning curves of XLM, CL-SemFace and VQ-SemFace side by side: the encoder
MLM and the decoder stage's loss of each at the same preset, batch, data and steps, in a table
(curves.md), a plot (curves.png) and MLflow, against the uniform guess ln V.

Runs on a CPU with a reduced batch and on GPUs at full size; finished runs are reused (more
--steps continue them). The data defaults to the demo's (make demo builds it).

Examples::

    python tools/learning_curves.py --steps 60 --log-every 10
    python tools/learning_curves.py --preset paper --model encoder_layers=1 \\
        --model decoder_layers=1 --model extractor_layers=1 --max-tokens 512 --steps 100 \\
        --workdir runs/curves-paper-cpu
    python tools/learning_curves.py --preset paper --max-tokens 16384 --procs 1 --steps 300 \\
        --workdir runs/curves-paper-gpu --systems xlm,cl,vq,vq-k4096

Exit status: 0 on success, 2 for bad options, missing data or a failed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megasemface.cli.parsing import command_parser, parse_or_status
from megasemface.pipeline.learning_curves import CurvesConfig

__all__ = ["build_parser", "config_from_args", "main"]

PROG = "learning_curves"


def build_parser() -> argparse.ArgumentParser:
    d = CurvesConfig
    parser = command_parser(__doc__, prog=PROG)
    add = parser.add_argument
    add(
        "--systems",
        default=",".join(d.systems),
        help="comma-separated pipeline systems that pre-train in the encoder or joint stage "
        f"(default: {','.join(d.systems)}; ablations such as vq-k4096 too)",
    )
    add("--preset", default=d.preset, help=f"model preset: tiny, small or paper ({d.preset})")
    add(
        "--model",
        dest="model_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model option of every system's run, after the preset (repeatable)",
    )
    add(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"tokens per batch and process ({d.max_tokens:,}; 16,384 on a GPU at full size)",
    )
    add("--steps", type=int, default=d.steps, help=f"training steps of each run ({d.steps})")
    add("--log-every", type=int, default=d.log_every, help=f"steps between points ({d.log_every})")
    add("--seed", type=int, default=d.seed, help=f"seed of every run ({d.seed})")
    add("--lr", type=float, help="pre-training learning rate (default: 1e-4 paper, else 1e-3)")
    add("--shards", type=Path, default=d.shards, help=f"monolingual shards ({d.shards})")
    add("--spm-model", type=Path, default=d.spm_model, help=f"SentencePiece model ({d.spm_model})")
    add("--cl-table", type=Path, help="CL-SemFace's table (default: built from the shards)")
    add(
        "--valid-prefix",
        type=Path,
        default=d.valid_prefix,
        help=f"validation text PREFIX.<lang> of every language ({d.valid_prefix})",
    )
    add("--no-validation", action="store_true", help="no validation curve")
    add(
        "--valid-every",
        type=int,
        default=d.valid_every,
        help=f"steps between validations ({d.valid_every})",
    )
    add(
        "--valid-sentences",
        type=int,
        default=d.valid_sentences,
        help=f"validation sentences of each language ({d.valid_sentences})",
    )
    add("--workdir", type=Path, default=d.workdir, help=f"runs and report ({d.workdir})")
    add("--procs", type=int, help="training processes (default: the GPUs, else 2 on a CPU)")
    add("--deepspeed-config", type=Path, help="default: ds_configs/zero2_bf16.json on GPU")
    add("--experiment", default=d.experiment, help=f"MLflow experiment ({d.experiment})")
    add("--no-tracking", action="store_true", help="no MLflow: curves from the runs' logs")
    return parser


def _default_procs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def config_from_args(args: argparse.Namespace) -> CurvesConfig:
    """Raises ValueError for bad values, naming the option."""
    fields = {f.name for f in dataclasses.fields(CurvesConfig)}
    values = {name: value for name, value in vars(args).items() if name in fields}
    values["systems"] = tuple(item.strip() for item in args.systems.split(",") if item.strip())
    values["model_options"] = tuple(args.model_options)
    values["procs"] = args.procs if args.procs is not None else _default_procs()
    values["tracking"] = not args.no_tracking
    if args.no_validation:
        values["valid_prefix"] = None
    return CurvesConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = parse_or_status(build_parser(), argv)
    if isinstance(args, int):
        return args
    from megasemface.pipeline.launcher import LaunchError
    from megasemface.pipeline.learning_curves import run_curves
    from megasemface.tracking.compare import CompareError

    try:
        run_curves(config_from_args(args))
    except (ValueError, FileNotFoundError, LaunchError, CompareError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
