"""What a pipeline run builds: its budgets and options (the systems it compares and the
settings it fine-tunes them in are in :mod:`megasemface.pipeline.systems`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megasemface.data.demo.demo_corpus import DEFAULT_LOCALE_DIR, SOURCE_LANG
from megasemface.data.demo.documentation import DEFAULT_DOC_ROOT
from megasemface.data.demo.gettext_catalogs import find_catalogs
from megasemface.pipeline.settings import SETTINGS
from megasemface.pipeline.settings import setting as find_setting
from megasemface.pipeline.systems import (
    ABLATIONS,
    PAPER_SCALE,
    RELATED,
    SYSTEMS,
    System,
)

__all__ = [
    "BUDGETS",
    "PipelineConfig",
    "parse_finetune_grid",
    "parse_languages",
    "parse_seeds",
    "seeded",
]


@dataclasses.dataclass(kw_only=True)
class PipelineConfig:
    """Budgets and options of a pipeline run; ``BUDGETS`` holds the named ones (`--budget`)."""

    workdir: Path = Path("runs/demo")
    """Everything is built here: corpus, tokenizer, shards, runs, models, the MLflow store."""
    tracking_uri: str | None = None
    """The MLflow store of every run, the model registry and the report, e.g. an
    ``mlflow server``'s ``http://mlflow-host:5000``. None: ``sqlite:///<workdir>/mlflow.db``."""
    pair: str = "en-de"
    """en-xx: the demo corpus translates from English."""
    languages: tuple[str, ...] = ()
    """Several languages, English first (``--languages en,de,fr,ro``): one pre-training over
    all of them, then fine-tuning and test of every pair en-xx from it, in one table
    (:attr:`pairs`); replaces ``pair``. Empty: the one pair ``pair``."""
    locale_dir: Path = Path(DEFAULT_LOCALE_DIR)
    doc_root: Path = Path(DEFAULT_DOC_ROOT)
    """Where the Debian documentation packages of the demo corpus are installed (the handbook,
    the Debian Reference, man pages); without them the corpus is the catalogs alone."""
    systems: tuple[str, ...] = ("transformer", "cl", "vq")
    settings: tuple[str, ...] = ("supervised",)
    model_preset: str = "tiny"
    """Model preset of every run."""
    model_options: tuple[str, ...] = ()
    vocab_size: int = 8000
    """Joint SentencePiece vocabulary. At the demo budget 4,000 pieces shorten every step
    but scored lower on validation over 3 seeds (docs/reproduce.md)."""
    train_pairs: int = 2000
    """The low-resource slice of the parallel training data (supervised setting): the
    regime of the paper's claim, where monolingual text dwarfs the parallel data. On the
    demo corpus 2,000 of its 24,570 training pairs against every monolingual sentence (from
    the catalogs alone 25,958 English and 24,485 German lines, 12-13 times as many; with
    Debian's documentation 71,310 and 83,616). With the whole split pre-training's lead was
    gone by the end of fine-tuning (docs/reproduce.md#the-demo-budget)."""
    test_sentences: int = 1000
    """Test sentences translated per direction (0: all)."""
    valid_sentences: int = 200
    pretrain_steps: int = 500
    finetune_steps: int = 500
    """As many pre-training steps as fine-tuning steps, so that pre-training's compute is at
    least fine-tuning's, and few enough that ``make demo`` finishes within 20 minutes on 2
    CPU cores with the install (docs/reproduce.md#the-demo-budget)."""
    valid_interval: int = 100
    checkpoints_per_run: int = 4
    """Checkpoints each training run saves, evenly spaced, the last at its end: where an
    interrupted run resumes from (each save stalls training while every rank writes)."""
    max_tokens: int = 2048
    """Tokens per batch and rank."""
    compile: bool = False
    """Every training run compiles its Transformer layers (train.py ``--compile``)."""
    warmup_steps: int = 100
    """Fine-tuning warm-up of the inverse square-root schedule."""
    lr: float = 4e-3
    """Fine-tuning peak learning rate."""
    finetune_grid: tuple[tuple[float, int | None], ...] = ()
    """Fine-tuning settings tried for every system, setting and seed, as (peak learning
    rate, warm-up steps; None: ``warmup_steps``): each is trained, and the one with the
    highest validation BLEU is tested. Every run keeps its best checkpoint on validation,
    so its steps are chosen on validation too. Empty: ``lr`` and ``warmup_steps`` alone."""
    pretrain_lr: float = 1e-3
    """Pre-training learning rate (constant)."""
    denoise_schedule: str = "0:1,300:0.1,600:0"
    beam: int = 1
    """Beam size when translating the test set (1: greedy)."""
    no_repeat_ngram_size: int | None = None
    """Fine-tuning's generation (validation, back-translation) and the test translation
    generate no n-gram of this size twice in one output (0: no limit). None: the setting's
    own, 0 supervised and 3 unsupervised, where it keeps a weak model's loops ("the the the")
    out of the back-translations it learns from (docs/reproduce.md: chosen on validation
    BLEU)."""
    cl_dim_from_model: bool = True
    cl_epochs: int = 10
    """Skip-gram epochs of the CL-SemFace table, as the documented command trains it: on a
    corpus of the demo's size, more passes over the same text map more dictionary words to
    their translation (docs/results.md#the-table-against-the-amount-of-text)."""
    ras_dictionary: Path | None = None
    """The word dictionary of the systems with random aligned substitution (mRASP, the RAS
    ablations), a file named ``<src>-<tgt>.tsv``; None: induced from the cross-lingual
    embeddings, ``<workdir>/ras/<pair>.tsv``. Not the demo corpus' ``dict/<pair>.tsv``: that
    is the evaluation's gold dictionary, made from one-word messages of every split, test
    included."""
    ras_min_score: float = 0.25
    """The induced dictionary's confidence threshold: the lowest CSLS score of a pair kept."""
    ras_words: int = 1000
    """The induced dictionary translates this many of each language's most frequent words
    (mRASP: the 1,000 most frequent)."""
    small_shards: bool = True
    """Shards of 8 samples of 8k tokens, so a small corpus still gives every rank shards;
    off: the shard builder's defaults, for large corpora."""
    shard_jobs: int = 2
    """Encoding processes of the shard builder."""
    procs: int = dataclasses.field(default_factory=lambda: min(2, cuda_devices()) or 2)
    """Training processes on this machine (GPUs, or CPU processes); by default 2, or one per
    GPU on a machine with fewer (each rank takes a GPU of its own)."""
    deepspeed_config: Path | None = None
    """Default: ds_configs/cpu_fp32_zero2.json on CPU, ds_configs/zero2_bf16.json on GPU."""
    hostfile: Path | None = None
    seed: int = 0
    """Seed of the data steps (the SentencePiece model's sampling) and, without ``seeds``, of
    the one training run per system."""
    seeds: tuple[int, ...] = ()
    """Seeds of the training runs: every system is pre-trained, connected, fine-tuned and
    tested once per seed, on the same data (built once, with ``seed``). Empty: ``(seed,)``."""
    experiment: str | None = None
    """MLflow experiment (default: megasemface-<pair>)."""

    def __post_init__(self) -> None:
        src, _, tgt = self.pair.partition("-")
        if src != "en" or not tgt:
            raise ValueError(
                f"--pair must be en-xx (the demo catalogs translate English): {self.pair}"
            )
        for key in self.systems:
            if not any(key in group for group in (SYSTEMS, ABLATIONS, PAPER_SCALE, RELATED)):
                known = ", ".join([*SYSTEMS, *ABLATIONS, *PAPER_SCALE, *RELATED])
                raise ValueError(f"unknown system {key!r}; known: {known}")
        for setting in self.settings:
            find_setting(setting)
        names = ("pretrain_steps", "finetune_steps", "valid_interval", "procs", "train_pairs")
        names += ("checkpoints_per_run",)
        for name in (*names, "ras_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.no_repeat_ngram_size is not None and self.no_repeat_ngram_size < 0:
            raise ValueError("--no-repeat-ngram-size must be >= 0 (0: no limit)")
        gpus = cuda_devices()
        if self.hostfile is None and gpus and self.procs > gpus:
            raise ValueError(
                f"--procs {self.procs}: each rank takes a GPU, this machine has {gpus}"
            )
        for lr, warmup in self.finetune_grid:
            if not lr > 0 or (warmup is not None and warmup < 1):
                raise ValueError(
                    f"--finetune-grid: learning rates must be > 0 and warm-ups >= 1, got "
                    f"{lr:g}:{warmup}"
                )
        if len(set(self.finetune_choices)) < len(self.finetune_choices):
            raise ValueError("--finetune-grid names one setting more than once")
        for name in ("lr", "pretrain_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for seed in (self.seed, *self.seeds):
            # Refused here, before the data steps, rather than by a training run much later.
            if seed < 0:
                raise ValueError(f"seeds must be >= 0, got {seed}")
        repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if repeated:
            given = ",".join(map(str, self.seeds))
            raise ValueError(f"--seeds {given}: seed {repeated[0]} is given more than once")
        self._check_languages()

    def _check_languages(self) -> None:
        """What ``--languages`` may hold; the catalogs are :meth:`check_catalogs`'."""
        if not self.languages:
            return
        given = ",".join(self.languages)
        bad = [lang for lang in self.languages if not LANG_CODE.fullmatch(lang)]
        if bad:
            raise ValueError(
                f"--languages {given}: {bad[0]!r} is not a language code (e.g. de, pt_BR)"
            )
        repeated = sorted({lang for lang in self.languages if self.languages.count(lang) > 1})
        if repeated:
            raise ValueError(f"--languages {given}: {repeated[0]} is given more than once")
        if self.languages[0] != SOURCE_LANG:
            raise ValueError(
                f"--languages {given}: must start with {SOURCE_LANG} (the demo catalogs "
                f"translate English; every pair is {SOURCE_LANG}-xx)"
            )
        if len(self.languages) < 3:
            raise ValueError(
                f"--languages {given}: give {SOURCE_LANG} and at least two others (one other "
                f"language is --pair {SOURCE_LANG}-xx)"
            )
        if not all(SETTINGS[name].parallel for name in self.settings):
            raise ValueError(
                "--languages fine-tunes each pair supervised only: use --settings supervised"
            )
        for key in self.systems:
            system = self.system(key)  # a known one: checked above
            if system.pretraining_pairs:
                raise ValueError(
                    f"--languages: system {key!r} pre-trains on one pair's parallel data; "
                    "a run over several languages pre-trains on monolingual text"
                )
            if system.pretraining_ras or system.finetuning_ras:
                raise ValueError(
                    f"--languages: system {key!r} substitutes words from one pair's "
                    "dictionary, which a run over several languages does not have yet"
                )

    def check_catalogs(self) -> None:
        """Every language of :attr:`all_langs` other than English has gettext catalogs in
        ``locale_dir`` (the demo corpus is made of them).

        Raises:
            ValueError: one line naming the language and the directory.
        """
        for lang in self.all_langs:
            if lang != SOURCE_LANG and not find_catalogs(self.locale_dir, lang):
                where = self.locale_dir / lang / "LC_MESSAGES"
                option = "--languages" if self.languages else "--pair"
                raise ValueError(
                    f"{option}: no gettext catalogs (*.mo) for {lang!r} in {where}; leave it "
                    "out, install its translations or give --locale-dir"
                )

    @property
    def finetune_choices(self) -> tuple[tuple[float, int], ...]:
        """The (peak learning rate, warm-up steps) settings every fine-tuning tries."""
        if not self.finetune_grid:
            return ((self.lr, self.warmup_steps),)
        return tuple((lr, self.warmup_steps if w is None else w) for lr, w in self.finetune_grid)

    @property
    def multilingual(self) -> bool:
        """One pre-training over :attr:`languages`, fine-tuned on each of its pairs."""
        return bool(self.languages)

    @property
    def pairs(self) -> tuple[str, ...]:
        """The pairs fine-tuned and tested: each en-xx of ``languages``, else ``pair``."""
        if self.languages:
            return tuple(f"{self.languages[0]}-{lang}" for lang in self.languages[1:])
        return (self.pair,)

    @property
    def all_langs(self) -> tuple[str, ...]:
        """Every language of the corpus, the tokenizer and the pre-training."""
        return self.languages or self.langs

    @property
    def langs(self) -> tuple[str, str]:
        src, _, tgt = self.pair.partition("-")
        return src, tgt

    def no_repeat_ngram(self, setting: str) -> int:
        """:attr:`no_repeat_ngram_size` of fine-tuning in ``setting``."""
        if self.no_repeat_ngram_size is not None:
            return self.no_repeat_ngram_size
        return SETTINGS[setting].no_repeat_ngram

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds every system is trained with, in the order given."""
        return self.seeds or (self.seed,)

    @property
    def experiment_name(self) -> str:
        return self.experiment or f"megasemface-{self.name}"

    @property
    def name(self) -> str:
        """The pair (``en-de``), or the languages (``en-de-fr-ro``)."""
        return "-".join(self.languages) if self.languages else self.pair

    def system(self, key: str) -> System:
        return SYSTEMS.get(key) or ABLATIONS.get(key) or PAPER_SCALE.get(key) or RELATED[key]


def cuda_devices() -> int:
    """The CUDA devices of this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


LANG_CODE = re.compile(r"[A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?(?:@[A-Za-z0-9]+)?")
"""A gettext language code, as the demo corpus reads them (de, pt_BR, sr@latin)."""


def parse_languages(text: str) -> tuple[str, ...]:
    """``--languages en,de,fr``: comma-separated codes (``PipelineConfig`` checks them)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_finetune_grid(text: str) -> tuple[tuple[float, int | None], ...]:
    """``--finetune-grid 1e-3:400,2e-3,4e-3:100``: comma-separated peak learning rates, each
    with its warm-up steps after a colon (without one: ``--warmup-steps``).

    Raises:
        ValueError: a one-line message naming the bad item.
    """
    grid: list[tuple[float, int | None]] = []
    for item in (part.strip() for part in text.split(",")):
        lr, _, warmup = item.partition(":")
        try:
            grid.append((float(lr), int(warmup) if warmup else None))
        except ValueError:
            raise ValueError(
                f"--finetune-grid takes LR or LR:WARMUP items, comma-separated (e.g. "
                f"1e-3:400,2e-3:100), got {item!r}"
            ) from None
    return tuple(grid)


def seeded(name: str, seed: int) -> str:
    """The name of a run or model directory for one seed: ``name`` for seed 0 (the paths of a
    single-seed pipeline, so its work directories are reused by a run with more seeds),
    ``name-s<seed>`` otherwise."""
    return name if seed == 0 else f"{name}-s{seed}"


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2``: comma-separated non-negative integers (``PipelineConfig`` refuses
    repeated ones).

    Raises:
        ValueError: a one-line message naming the bad item.
    """
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not item.isdecimal():
            raise ValueError(
                f"--seeds takes comma-separated non-negative integers (e.g. 0,1,2), "
                f"got {item!r} in {text!r}"
            )
    return tuple(int(item) for item in items)


BUDGETS: dict[str, dict[str, object]] = {
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
    "lowres": {
        "workdir": Path("runs/lowres"),
        "settings": ("supervised",),
        "train_pairs": 2000,
        "pretrain_steps": 1000,
        "finetune_steps": 1000,
        "valid_interval": 100,
        "finetune_grid": ((2e-3, 100), (4e-3, 100), (8e-3, 100)),
    },
    "study": {
        "workdir": Path("runs/study"),
        "systems": tuple(SYSTEMS),
        "settings": ("supervised",),
        "model_preset": "small",
        "train_pairs": 10_000,
        "pretrain_steps": 800,
        "finetune_steps": 1000,
        "valid_interval": 250,
        "lr": 2e-3,
        "denoise_schedule": "0:1,500:0.1,1000:0",
    },
    "gpu": {
        "workdir": Path("runs/gpu"),
        "systems": tuple(SYSTEMS),
        "settings": ("supervised",),
        "model_preset": "paper",
        "vocab_size": 60_000,
        "train_pairs": 10_000,
        "test_sentences": 100,
        "valid_sentences": 100,
        "pretrain_steps": 40,
        "finetune_steps": 40,
        "valid_interval": 40,
        "checkpoints_per_run": 1,
        "warmup_steps": 10,
        "lr": 3e-4,
        "pretrain_lr": 1e-4,
        "max_tokens": 16_384,
        "cl_epochs": 1,
        "procs": 1,
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
        "cl_epochs": 3,  # 50M sentences a language: the text, not the passes, is the lever
        "beam": 5,
        "denoise_schedule": "0:1,100000:0.1,300000:0",
        "procs": 8,
        "small_shards": False,
        "shard_jobs": 16,
    },
}
"""Named budgets: demo (the README's main command: the low-resource regime made to finish
within 20 minutes on 2 CPU cores, the install included; what it took: docs/results.md),
lowres (below), smoke (the test suite's reduced end-to-end run), study (below), gpu (below)
and paper (the paper's scale, on GPUs). A budget may name its systems and settings;
``--systems`` and ``--settings`` override them.

lowres: the regime the paper's gains are claimed in (supervised), where monolingual text
dwarfs the parallel data: 2,000 training pairs against every monolingual sentence of each language
(on the demo corpus from the catalogs alone 25,958 English and 24,485 German ones, 12 to 13
times as many; with Debian's documentation 70,870 and 83,128), as many
pre-training steps as fine-tuning steps (a joint SemFace step costs more than a fine-tuning
step of the same batch), and fine-tuning's peak learning rate chosen per system, setting
and seed on validation BLEU from a grid, each run's steps by its best checkpoint on
validation, so the Transformer gets its best setting too. docs/reproduce.md shows the grid's
table.

study: the five systems of Table 3, supervised, in about three hours on the 2-core CPU
machine with 2 processes: the ``small`` model (d 128, 4+4 layers; see its docstring for why
not wider), 800 pre-training steps and 1,000 fine-tuning steps at a peak learning rate of
2e-3 (the demo's budget when the study's runs were measured: 400, 800 and 2e-3), the
demo's data, batches and pre-training learning rate otherwise. The step counts come from
the demo's measured step times on that machine times the small model's measured cost per
step, so that every system fits the three hours; the arithmetic is in docs/results.md.
The joint SemFace stages take most of it: their steps run both the encoder and the decoder
stage. ``--seeds 0,1,2`` takes three times as long.

gpu: the five systems of Table 3, supervised, at the paper preset (d 1,024, 6+6 layers,
VQ-SemFace's 102,400-code codebook, a 60,000-piece vocabulary) on one H200 in at most 8
minutes end to end, with 16,384-token batches and 40 steps a run: a check that every system
runs at the paper's size, not a comparison of their results. How its steps were sized:
docs/reproduce.md#the-gpu-budget (tests/test_gpu_budget.py holds the arithmetic)."""
