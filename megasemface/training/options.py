"""The training run's options: one typed config, built from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "TrainConfig", "add_train_arguments", "train_config_from_args"]

STAGES = ("encoder", "decoder", "joint", "mbart")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs besides the DeepSpeed config."""

    stage: str
    """encoder, decoder, joint (Algorithm 1) or mbart (the denoising baseline)."""
    interface: str
    """cl, vq or none (the XLM baseline: encoder stage only)."""
    data: Path
    """Shard directory or its manifest.json."""
    spm_model: Path
    output_dir: Path
    preset: str = "tiny"
    model_options: list[str] = dataclasses.field(default_factory=list)
    model_config_file: Path | None = None
    cl_table: Path | None = None
    init_from: Path | None = None
    """Encoder-stage run directory (or checkpoint) whose VQ layer the decoder stage uses."""
    decoder_objective: str = "clm"
    mse_weight: float = 1.0
    diversity_weight: float = 1.0
    l2_weight: float = 1.0
    mp_size: int = 1
    steps: int = 1000
    seed: int = 0
    max_tokens: int = 4096
    num_workers: int = 0
    save_interval: int = 500
    keep_last: int = 3
    log_interval: int = 10
    max_consecutive_skips: int = 8
    experiment: str = "megasemface"
    run_name: str | None = None
    tracking_uri: str | None = None
    no_tracking: bool = False
    log_sample_ids: bool = False
    inject_nan_at: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"--stage must be one of {STAGES}, got {self.stage!r}")
        if self.interface not in ("cl", "vq", "none"):
            raise ValueError(f"--interface must be cl, vq or none, got {self.interface!r}")
        if self.interface == "none" and self.stage not in ("encoder", "mbart"):
            raise ValueError("--interface none (XLM) has only an encoder stage")
        if self.stage == "decoder" and self.interface == "vq" and self.init_from is None:
            raise ValueError(
                "the VQ decoder stage needs --init-from: the encoder-stage run whose codebook "
                "it uses (frozen)"
            )
        for name in ("steps", "save_interval", "keep_last", "log_interval", "mp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()
        }


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig(
        stage="encoder", interface="vq", data=Path(), spm_model=Path(), output_dir=Path()
    )
    add = parser.add_argument
    add(
        "--local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", -1)),
        help="set by the deepspeed launcher",
    )
    add("--stage", required=True, choices=STAGES)
    add("--interface", default="vq", choices=("cl", "vq", "none"))
    add("--data", type=Path, required=True, help="shard directory (with manifest.json)")
    add("--spm-model", type=Path, required=True, help="the SentencePiece model of the shards")
    add("--output-dir", type=Path, required=True, help="checkpoints, logs and MLflow store")
    add("--preset", default=d.preset, help="model preset: tiny or paper")
    add(
        "--model",
        dest="model_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model option override, e.g. --model d_model=128 --model vq.layout=product",
    )
    add("--model-config", dest="model_config_file", type=Path, help="JSON file of model options")
    add("--cl-table", type=Path, help="cross-lingual embedding table (safetensors) for cl")
    add("--init-from", type=Path, help="encoder-stage run whose VQ layer the decoder stage uses")
    add("--decoder-objective", default=d.decoder_objective, choices=("clm", "mlm"))
    add("--mse-weight", type=float, default=d.mse_weight)
    add("--diversity-weight", type=float, default=d.diversity_weight)
    add("--l2-weight", type=float, default=d.l2_weight)
    add("--mp-size", type=int, default=d.mp_size, help="model-parallel size of the codebook")
    add("--steps", type=int, default=d.steps, help="optimizer steps in all")
    add("--seed", type=int, default=d.seed)
    add("--max-tokens", type=int, default=d.max_tokens, help="tokens per batch, with padding")
    add("--num-workers", type=int, default=d.num_workers, help="loader workers per rank")
    add("--save-interval", type=int, default=d.save_interval)
    add("--keep-last", type=int, default=d.keep_last)
    add("--log-interval", type=int, default=d.log_interval)
    add("--max-consecutive-skips", type=int, default=d.max_consecutive_skips)
    add("--experiment", default=d.experiment, help="MLflow experiment")
    add("--run-name", help="MLflow run name")
    add(
        "--tracking-uri",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite in the output directory)",
    )
    add("--no-tracking", action="store_true", help="do not log to MLflow")
    add(
        "--log-sample-ids",
        action="store_true",
        help="write the sentence ids of every step to samples-rank*.jsonl (for audits)",
    )
    add(
        "--inject-nan-at",
        type=int,
        action="append",
        default=[],
        help="make the loss non-finite at this step (to test the skip logic)",
    )


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
