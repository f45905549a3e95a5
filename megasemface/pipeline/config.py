"""What a pipeline run builds: the systems compared, the settings, the budgets.

A *system* is one row of the paper's tables: how the translation model is initialised
before fine-tuning. A *setting* is how it is fine-tuned: supervised on a low-resource slice
of parallel data, or unsupervised (denoising and back-translation on monolingual data).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megasemface.data.demo_corpus import DEFAULT_LOCALE_DIR

__all__ = ["ABLATIONS", "PRESETS", "SETTINGS", "SYSTEMS", "PipelineConfig", "System"]


@dataclasses.dataclass(frozen=True)
class System:
    """One pre-training recipe and how its stages are connected."""

    key: str
    display: str
    """The name in tables and plots (the paper's row label)."""
    stage: str | None
    """train.py --stage of the pre-training run; None: no pre-training."""
    interface: str = "none"
    options: tuple[str, ...] = ()
    """Extra train.py options of the pre-training run (ablations)."""
    connect: str = "semface"
    """semface (encoder and decoder of the run), xlm (encoder into both) or mbart."""


SYSTEMS: dict[str, System] = {
    s.key: s
    for s in (
        System("transformer", "Transformer", None),
        System("xlm", "XLM", "encoder", "none", connect="xlm"),
        System("mbart", "mBART", "mbart", "none", connect="mbart"),
        System("cl", "CL-SemFace", "joint", "cl"),
        System("vq", "VQ-SemFace", "joint", "vq"),
    )
}
"""The paper's Tables 3 and 4, in their order."""

ABLATIONS: dict[str, System] = {
    s.key: s
    for s in (
        System("cl-no-mse", "CL-SemFace w/o MSE", "joint", "cl", ("--mse-weight", "0")),
        System("vq-no-div", "VQ-SemFace w/o diversity", "joint", "vq", ("--diversity-weight", "0")),
        System("vq-no-l2", "VQ-SemFace w/o L2", "joint", "vq", ("--l2-weight", "0")),
        System("cl-mlm", "CL-SemFace decoder MLM", "joint", "cl", ("--decoder-objective", "mlm")),
        System("vq-mlm", "VQ-SemFace decoder MLM", "joint", "vq", ("--decoder-objective", "mlm")),
    )
}
"""The paper's Table 5."""

SETTINGS = ("supervised", "unsupervised")


@dataclasses.dataclass(kw_only=True)
class PipelineConfig:
    """Budgets and options of a pipeline run; ``PRESETS`` holds named ones."""

    workdir: Path = Path("runs/demo")
    """Everything is built here: corpus, tokenizer, shards, runs, models, the MLflow store."""
    pair: str = "en-de"
    """en-xx: the demo corpus translates from English."""
    locale_dir: Path = Path(DEFAULT_LOCALE_DIR)
    systems: tuple[str, ...] = ("transformer", "cl", "vq")
    settings: tuple[str, ...] = ("supervised",)
    model_preset: str = "tiny"
    """Model preset of every run."""
    model_options: tuple[str, ...] = ()
    vocab_size: int = 8000
    train_pairs: int = 10_000
    """The low-resource slice of the parallel training data (supervised setting)."""
    test_sentences: int = 1000
    """Test sentences translated per direction (0: all)."""
    valid_sentences: int = 200
    pretrain_steps: int = 400
    finetune_steps: int = 800
    valid_interval: int = 200
    max_tokens: int = 2048
    """Tokens per batch and rank."""
    warmup_steps: int = 100
    """Fine-tuning warm-up of the inverse square-root schedule."""
    lr: float = 2e-3
    """Fine-tuning peak learning rate."""
    pretrain_lr: float = 1e-3
    """Pre-training learning rate (constant)."""
    denoise_schedule: str = "0:1,400:0.1,800:0"
    beam: int = 1
    """Beam size when translating the test set (1: greedy)."""
    cl_dim_from_model: bool = True
    cl_epochs: int = 3
    small_shards: bool = True
    """Shards of 8 samples of 8k tokens, so a small corpus still gives every rank shards;
    off: the shard builder's defaults, for large corpora."""
    shard_jobs: int = 2
    """Encoding processes of the shard builder."""
    procs: int = 2
    """Processes of the deepspeed launcher (GPUs, or CPU processes)."""
    deepspeed_config: Path | None = None
    """Default: ds_configs/cpu_fp32_zero2.json on CPU, ds_configs/zero2_bf16.json on GPU."""
    hostfile: Path | None = None
    seed: int = 0
    experiment: str | None = None
    """MLflow experiment (default: megasemface-<pair>)."""

    def __post_init__(self) -> None:
        src, _, tgt = self.pair.partition("-")
        if src != "en" or not tgt:
            raise ValueError(
                f"--pair must be en-xx (the demo catalogs translate English): {self.pair}"
            )
        for key in self.systems:
            if key not in SYSTEMS and key not in ABLATIONS:
                known = ", ".join([*SYSTEMS, *ABLATIONS])
                raise ValueError(f"unknown system {key!r}; known: {known}")
        for setting in self.settings:
            if setting not in SETTINGS:
                raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
        for name in ("pretrain_steps", "finetune_steps", "valid_interval", "procs", "train_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("lr", "pretrain_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def langs(self) -> tuple[str, str]:
        src, _, tgt = self.pair.partition("-")
        return src, tgt

    @property
    def experiment_name(self) -> str:
        return self.experiment or f"megasemface-{self.pair}"

    def system(self, key: str) -> System:
        return SYSTEMS.get(key) or ABLATIONS[key]


PRESETS: dict[str, dict[str, object]] = {
    "demo": {},
    "smoke": {
        "workdir": Path("runs/smoke"),
        "train_pairs": 2000,
        "test_sentences": 50,
        "valid_sentences": 20,
        "pretrain_steps": 3,
        "finetune_steps": 3,
        "valid_interval": 3,
        "warmup_steps": 2,
        "max_tokens": 512,
        "cl_epochs": 1,
        "denoise_schedule": "0:1,3:0",
    },
    "paper": {
        "workdir": Path("runs/paper"),
        "model_preset": "paper",
        "vocab_size": 60_000,
        "train_pairs": 100_000,
        "test_sentences": 0,
        "valid_sentences": 3000,
        "pretrain_steps": 500_000,
        "finetune_steps": 100_000,
        "valid_interval": 2000,
        "warmup_steps": 4000,
        "lr": 1e-4,
        "pretrain_lr": 1e-4,
        "max_tokens": 4096,
        "beam": 5,
        "denoise_schedule": "0:1,100000:0.1,300000:0",
        "procs": 8,
        "small_shards": False,
        "shard_jobs": 16,
    },
}
"""Named budgets: demo (the README's main command, 2 CPU cores, under 30 minutes), smoke
(the test suite's reduced end-to-end run) and paper (the paper's scale, on GPUs)."""
