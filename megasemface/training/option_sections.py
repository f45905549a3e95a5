"""The sections of train.py's options that belong to the run itself: each a dataclass of
its fields, each field with its one default and its docstring, the one text of its
``--help`` line and of docs/options.md. ``TrainConfig`` holds them all, with the sections
the components own (the pre-training losses', each interface's). Nothing here imports torch:
parsing options reads it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megasemface.inference.length_limits import MAX_LEN_A, MAX_LEN_B

__all__ = [
    "LR_SCHEDULES",
    "DataOptions",
    "FinetuneOptions",
    "GenerationOptions",
    "ModelOptions",
    "OptimisationOptions",
    "RunOptions",
    "SubstitutionOptions",
    "TrackingOptions",
    "ValidationOptions",
]

LR_SCHEDULES = ("deepspeed", "inverse_sqrt")


@dataclasses.dataclass(kw_only=True)
class RunOptions:
    """What the run is and how it proceeds: its stage and interface, where it starts from
    and writes to, its steps, seed and checkpoints."""

    stage: str
    """encoder, decoder, joint (Algorithm 1), mbart (the denoising baseline), mrasp
    (translation pre-training on parallel shards with random aligned substitution), veco
    (in-sequence and cross-sequence MLM on monolingual and parallel shards) or finetune."""
    interface: str
    """cl, vq or none (the XLM baseline: encoder stage only); default vq, and none for
    mbart, mrasp, veco and finetune, which have no interface (finetune with cl or vq needs
    --init-from)."""
    output_dir: Path
    """Checkpoints, logs, metrics.jsonl and (without a tracking URI) the MLflow store."""
    init_from: Path | None = None
    """VQ decoder stage: the encoder-stage run (or checkpoint) whose codebook it uses;
    finetune: the seq2seq model directory to start from (tools/merge_checkpoints.py connect
    makes one; none: random, no pre-training)."""
    mp_size: int = 1
    """Model-parallel size: ranks the VQ codebook is split over."""
    steps: int = 1000
    """Optimizer steps in all (a resumed run counts from its checkpoint's step)."""
    seed: int = 0
    """Seed of the model's initialisation, the data order and every step's randomness."""
    compile: bool = False
    """Compile each Transformer layer's training forward with torch.compile (inductor; ZeRO
    1 or 2). The same losses as eager to float rounding, and exact resume; the README's
    benchmarks say when it pays."""
    save_interval: int = 500
    """Steps between checkpoints."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed."""
    log_interval: int = 10
    """Steps between logged metrics (progress line, metrics.jsonl, MLflow)."""
    max_consecutive_skips: int = 8
    """Stop after this many non-finite steps in a row (each is skipped on every rank)."""
    inject_nan_at: list[int] = dataclasses.field(default_factory=list)
    """Make the loss non-finite at these steps (to test the skip logic)."""


@dataclasses.dataclass(kw_only=True)
class ModelOptions:
    """The model's shape: a preset and the user's overrides."""

    preset: str = "tiny"
    """Model preset: tiny, small or paper (megasemface/nn/config.py)."""
    model_options: list[str] = dataclasses.field(default_factory=list)
    """Model option overrides KEY=VALUE, dotted for the interface's options, e.g.
    d_model=128 or vq.layout=product (ModelConfig's fields); applied after the preset and
    the model config file."""
    model_config_file: Path | None = None
    """JSON file of model options (a dict of ModelConfig's fields), applied after the
    preset."""


@dataclasses.dataclass(kw_only=True)
class DataOptions:
    """The shards the run reads and how they become batches."""

    data: Path
    """Shard directory or its manifest.json."""
    spm_model: Path
    """The SentencePiece model the shards were built with."""
    max_tokens: int = 4096
    """Tokens per batch and rank, padding included."""
    num_workers: int | None = None
    """Data loader worker processes per rank (0: read in the training process). None: one
    on a GPU, where reading ahead in its own process keeps the GPU fed (one worker reads
    78 times an H200's tokens/s, docs/data.md), 0 on the CPU, where a worker would take a
    core from the training."""


@dataclasses.dataclass(kw_only=True)
class OptimisationOptions:
    """The learning rate and its schedule (the rest of the optimizer is the DeepSpeed
    config's)."""

    lr: float | None = None
    """Peak learning rate (default: the DeepSpeed config's optimizer lr)."""
    lr_schedule: str | None = None
    """deepspeed (the config's optimizer and scheduler) or inverse_sqrt (warm-up, then
    1/sqrt decay); default inverse_sqrt for finetune, deepspeed otherwise."""
    warmup_steps: int = 4000
    """Warm-up steps of the inverse_sqrt schedule."""


@dataclasses.dataclass(kw_only=True)
class TrackingOptions:
    """Where the run is tracked (MLflow) and what it records besides its metrics."""

    experiment: str = "megasemface"
    """MLflow experiment."""
    run_name: str | None = None
    """MLflow run name."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite in output_dir)."""
    no_tracking: bool = False
    """Do not log to MLflow."""
    log_sample_ids: bool = False
    """Write every step's sentence ids and the rank's loss to samples-rank*.jsonl (audits)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Extra MLflow tags, KEY=VALUE (e.g. system=VQ-SemFace for tools/compare_runs.py)."""
    register_model: str | None = None
    """After the last step, register the best model (<output-dir>/best) in the MLflow model
    registry as a version of this registered model, with its lineage and validation scores
    as tags (needs --valid-prefix and tracking; launching the finished run again adds no
    second version)."""


@dataclasses.dataclass(kw_only=True)
class ValidationOptions:
    """What the run validates on, and how often."""

    valid_prefix: Path | None = None
    """Validation text: PREFIX.SRC and PREFIX.TGT files, e.g. corpus/en-de/valid. Fine-tuning
    translates them; SemFace's and XLM's pre-training stages score their MLM and decoder
    losses on PREFIX.<lang> of every language of the shards (noise-free codes)."""
    valid_interval: int = 1000
    """Steps between validations (fine-tuning: BLEU on the validation text, and the best
    model is kept; pre-training: the stage's losses on it)."""
    valid_max_sentences: int = 500
    """Validation sentences per direction (pre-training: per language), the first ones of
    the files."""
    valid_beam: int = 1
    """Beam size of validation (1: greedy)."""


@dataclasses.dataclass(kw_only=True)
class GenerationOptions:
    """How long and how repetitive a generated sentence may be (validation,
    back-translation)."""

    max_len_a: float = MAX_LEN_A
    """Generation stops after a x source length + b tokens (validation, back-translation)."""
    max_len_b: int = MAX_LEN_B
    """Generation stops after a x source length + b tokens; this is b."""
    no_repeat_ngram_size: int = 0
    """Generation (validation, back-translation): no n-gram of this size twice in one output
    (0: no limit), which keeps a weak model's loops out of its back-translations."""
    bt_min_len_a: float = 0.0
    """Back-translation only: a generated sentence may not end before this share of its
    source's length (0: no minimum). Keeps a direction that has collapsed onto a few short
    outputs from feeding them to the other direction as sources; validation and test
    translations are not constrained."""


@dataclasses.dataclass(kw_only=True)
class FinetuneOptions:
    """The fine-tuning stage's own options (``--stage finetune``)."""

    finetune_mode: str = "supervised"
    """supervised (parallel shards), unsupervised (monolingual shards: denoising plus
    online back-translation) or fusion (a deep-fusion model; shards of pairs and monolingual
    text: translation, target words, target sentence and MLM losses, each on its partition)."""
    fusion_weights: str = "1,1,1,1"
    """--finetune-mode fusion: the weights of the translation, target-words, target-sentence
    and MLM losses (Eq. 18 of deep fusion: all 1)."""
    directions: list[str] = dataclasses.field(default_factory=list)
    """Translation directions SRC-TGT to train (default: both directions of every pair)."""
    label_smoothing: float = 0.1
    """Label smoothing of the translation loss, in [0, 1)."""
    denoise_schedule: str = "0:1,100000:0.1,300000:0"
    """Unsupervised: the denoising loss weight, piecewise linear over STEP:WEIGHT points
    (the default is the paper's)."""


@dataclasses.dataclass(kw_only=True)
class SubstitutionOptions:
    """Random aligned substitution (mRASP): its dictionaries, probability and where it
    runs."""

    ras_dictionary: list[Path] = dataclasses.field(default_factory=list)
    """Random aligned substitution: word dictionaries, files named <src>-<tgt>.tsv of
    source<TAB>target[<TAB>score] lines, each pair used both ways (tools/build_cl_embeddings.py
    --dictionary-out induces one); read by --stage mrasp, --finetune-ras and
    --decoder-noise-ras."""
    ras_prob: float = 0.3
    """Random aligned substitution: the probability that a dictionary word is replaced by one
    of its translations (mRASP: 0.3)."""
    finetune_ras: bool = False
    """Supervised fine-tuning: random aligned substitution on the source side of every pair
    (needs --ras-dictionary; not in SemFace)."""
    decoder_noise_ras: bool = False
    """SemFace decoder stage (decoder or joint): random aligned substitution on the noised
    copy C(x) the interface reads, before word drop and shuffle (needs --ras-dictionary; not
    in SemFace)."""
