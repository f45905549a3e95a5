"""Consolidates, averages and connects pre-training checkpoints into model directories.

Examples::

    python tools/merge_checkpoints.py consolidate runs/vq-encoder --out models/vq-encoder
    python tools/merge_checkpoints.py consolidate runs/vq-encoder --out models/enc --mp-size 4
    python tools/merge_checkpoints.py connect --encoder runs/vq-encoder \\
        --decoder runs/vq-decoder --out models/vq-semface
    python tools/merge_checkpoints.py connect --encoder runs/xlm --out models/xlm
    python tools/merge_checkpoints.py connect --encoder runs/xlm --fusion deep --out models/fusion
    python tools/merge_checkpoints.py connect --mbart runs/mbart --out models/mbart
    python tools/merge_checkpoints.py connect --mbart runs/mbart --part encoder \\
        --out models/mbart-encoder
    python tools/merge_checkpoints.py connect --mbart runs/mrasp --out models/mrasp
    python tools/merge_checkpoints.py connect --mbart runs/veco --out models/veco
    python tools/merge_checkpoints.py average runs/vq-encoder --last 5 --out models/enc-avg5

A source is a run directory (its newest complete checkpoint), a checkpoint directory
(``checkpoints/step-NNNNNNNN``) or a ``pretraining`` model directory. Prints a JSON summary:
parameters, sources, the model's fp32 size and the process's peak RSS. DeepSpeed reads its
checkpoint files with pickle; every file is first read with torch's safe loader, and one it
refuses stops the tool with a line naming it (docs/checkpoints.md, what survives what).
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from megasemface.checkpoints.connect import PARTS
from megasemface.cli.parsing import CommandParser

__all__ = ["build_parser", "main"]

_MIB = 1024.0 * 1024.0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--out", type=Path, required=True, help="model directory to write")
        sub.add_argument(
            "--spm-model",
            type=Path,
            help="the run's SentencePiece model, if the path its options name has moved",
        )
        sub.add_argument("--overwrite", action="store_true", help="replace --out if it exists")

    consolidate = commands.add_parser(
        "consolidate", help="one stage checkpoint -> a pretraining model directory (fp32)"
    )
    consolidate.add_argument("source", type=Path, help="run, checkpoint or model directory")
    consolidate.add_argument(
        "--mp-size",
        type=int,
        help="also write the VQ codebook re-split for this many model-parallel ranks",
    )
    common(consolidate)

    connect = commands.add_parser(
        "connect", help="pre-training stages -> a seq2seq model directory"
    )
    connect.add_argument(
        "--encoder",
        type=Path,
        help="encoder-stage source (with --fusion deep also an mBART, mRASP or VECO run)",
    )
    connect.add_argument(
        "--decoder", type=Path, help="decoder-stage source (none: XLM-style, from the encoder)"
    )
    connect.add_argument(
        "--mbart",
        type=Path,
        help="source of a whole sequence-to-sequence pre-training, mBART, mRASP or VECO (instead)",
    )
    connect.add_argument("--seed", type=int, default=0, help="seed of parameters no stage has")
    connect.add_argument(
        "--bridge",
        choices=("none", "codebook"),
        default="none",
        help="VQ-SemFace: keep the encoder stage's codebook between the encoder and the "
        "cross-attention (codebook), or remove the interface as the paper does (default: none)",
    )
    connect.add_argument(
        "--fusion",
        choices=("none", "deep"),
        default="none",
        help="deep: the --encoder stage's encoder fused into a random decoder through the "
        "layer-wise coordinator of deep fusion (fine-tune with --finetune-mode fusion)",
    )
    connect.add_argument(
        "--part",
        choices=PARTS,
        default="whole",
        help="keep the encoder or the decoder alone and draw the other half at random from "
        "--seed, to measure which half of a pre-training carries its gain (default: whole)",
    )
    connect.add_argument(
        "--part-layers",
        type=int,
        help="deep fusion: encoder layers per part, one part per decoder layer (default: the "
        "encoder's depth over the run's decoder depth)",
    )
    common(connect)

    average = commands.add_parser(
        "average", help="the fp32 mean of checkpoints of one stage -> a pretraining directory"
    )
    average.add_argument(
        "sources", type=Path, nargs="+", help="a run directory with --last, or checkpoints"
    )
    average.add_argument("--last", type=int, help="average the run's N newest checkpoints")
    common(average)
    return parser


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / _MIB


def _peak_rss_mib() -> float:
    # ru_maxrss is the process's high-water mark, in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from megasemface import checkpoints as ckpt

    if args.command == "consolidate":
        state, meta = ckpt.load_stage(args.source)
        out = ckpt.write_pretraining_dir(
            args.out,
            state,
            meta,
            spm_model=args.spm_model,
            mp_size=args.mp_size,
            overwrite=args.overwrite,
        )
        return _summary("pretraining", out, state, {"stage": meta["source"]}, meta["interface"])
    if args.command == "average":
        sources = args.sources
        if args.last is not None:
            if len(sources) != 1:
                raise ValueError("--last takes one run directory")
            sources = ckpt.last_checkpoints(sources[0], args.last)
        state, meta = ckpt.average_checkpoints(sources)
        out = ckpt.write_pretraining_dir(
            args.out, state, meta, spm_model=args.spm_model, overwrite=args.overwrite
        )
        summary = _summary("pretraining", out, state, meta["source"], meta["interface"])
        summary["averaged_steps"] = meta["averaged"]["steps"]
        return summary
    if args.part != "whole" and args.fusion != "none":
        raise ValueError("--part keeps a half of a model; deep fusion's decoder is random")
    if args.mbart is not None:
        if args.encoder is not None or args.decoder is not None or args.fusion != "none":
            raise ValueError(
                "--mbart connects one run: leave out --encoder, --decoder and --fusion"
            )
        connected = ckpt.connect_mbart(args.mbart)
    elif args.encoder is None:
        raise ValueError("connect needs --encoder (and --decoder), or --mbart")
    elif args.fusion == "deep":
        if args.decoder is not None or args.bridge != "none":
            raise ValueError("--fusion deep connects an --encoder alone, without --bridge")
        connected = ckpt.connect_fusion(args.encoder, part_layers=args.part_layers, seed=args.seed)
    else:
        connected = ckpt.connect_runs(
            args.encoder, args.decoder, seed=args.seed, bridge=args.bridge
        )
    if args.part != "whole":
        connected = ckpt.keep_part(connected, args.part, seed=args.seed)
    out = ckpt.write_seq2seq_dir(
        args.out, connected, spm_model=args.spm_model, overwrite=args.overwrite
    )
    sources = {role: meta["source"] for role, meta in connected.sources.items()}
    origins: dict[str, int] = {}
    for origin in connected.parameters.values():
        role = origin.split(":", 1)[0]
        origins[role] = origins.get(role, 0) + 1
    summary = _summary("seq2seq", out, connected.state, sources, None)
    summary.update(mode=connected.mode, tensors_by_origin=origins)
    return summary


def _brief(source: Any) -> Any:
    """A source description with the per-parameter lists counted, for the summary."""
    if isinstance(source, list):
        return [_brief(item) for item in source]
    if not isinstance(source, dict):
        return source
    brief = {k: _brief(v) for k, v in source.items()}
    if "from_module_state" in brief:
        brief["from_module_state"] = len(brief["from_module_state"])
    return brief


def _summary(
    kind: str, out: Path, state: dict, sources: dict, interface: dict | None
) -> dict[str, Any]:
    params = sum(v.numel() for v in state.values())
    summary = {
        "out": str(out),
        "kind": kind,
        "tensors": len(state),
        "parameters": params,
        "fp32_mib": round(params * 4 / _MIB, 2),
        "sources": _brief(sources),
    }
    if interface:
        summary["interface"] = interface
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from safetensors import SafetensorError

    from megasemface.checkpoints import CheckpointError
    from megasemface.models.model_dir import ModelDirError
    from megasemface.models.seq2seq_init import ConnectError

    # Imported before the baseline is taken, so that the RSS growth is the work's own.
    importlib.import_module("deepspeed.utils.zero_to_fp32")
    before, started = _rss_mib(), time.perf_counter()
    try:
        summary = _run(args)
    except (CheckpointError, ConnectError, ModelDirError, ValueError, OSError) as exc:
        print(f"merge_checkpoints {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, SafetensorError) as exc:  # a metadata file or weights file lacks a key
        print(
            f"merge_checkpoints {args.command}: error: unreadable input: {exc!r}", file=sys.stderr
        )
        return 2
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["rss_before_mib"] = round(before, 1)
    summary["peak_rss_mib"] = round(_peak_rss_mib(), 1)
    summary["peak_rss_growth_vs_fp32"] = round(
        (summary["peak_rss_mib"] - before) / max(summary["fp32_mib"], 1e-9), 2
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
