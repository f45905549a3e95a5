"""What a pipeline run builds: its budgets and options (the systems it compares and the
settings it fine-tunes them in are in :mod:`megasemface.pipeline.systems`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megasemface.data.demo_corpus import DEFAULT_LOCALE_DIR, SOURCE_LANG
from megasemface.data.gettext_catalogs import find_catalogs
from megasemface.pipeline.systems import ABLATIONS, RELATED, SETTINGS, SYSTEMS, System

__all__ = [
    "BUDGETS",
    "PipelineConfig",
    "parse_languages",
    "parse_seeds",
    "seeded",
]


@dataclasses.dataclass(kw_only=True)
class PipelineConfig:
    """Budgets and options of a pipeline run; ``BUDGETS`` holds the named ones (`--budget`)."""

    workdir: Path = Path("runs/demo")
    """Everything is built here: corpus, tokenizer, shards, runs, models, the MLflow store."""
    pair: str = "en-de"
    """en-xx: the demo corpus translates from English."""
    languages: tuple[str, ...] = ()
    """Several languages, English first (``--languages en,de,fr,ro``): one pre-training over
    all of them, then fine-tuning and test of every pair en-xx from it, in one table
    (:attr:`pairs`); replaces ``pair``. Empty: the one pair ``pair``."""
    locale_dir: Path = Path(DEFAULT_LOCALE_DIR)
    systems: tuple[str, ...] = ("transformer", "cl", "vq")
    settings: tuple[str, ...] = ("supervised",)
    model_preset: str = "tiny"
    """Model preset of every run."""
    model_options: tuple[str, ...] = ()
    vocab_size: int = 8000
    """Joint SentencePiece vocabulary. At the demo budget 4,000 pieces shorten every step
    but scored lower on validation over 3 seeds (docs/reproduce.md)."""
    train_pairs: int = 10_000
    """The low-resource slice of the parallel training data (supervised setting)."""
    test_sentences: int = 1000
    """Test sentences translated per direction (0: all)."""
    valid_sentences: int = 200
    pretrain_steps: int = 200
    finetune_steps: int = 600
    """With ``lr``, chosen on validation BLEU (docs/reproduce.md#the-demo-budget): 200 and 600
    steps at 4e-3 score above 400 and 800 at 2e-3, the budget before, in two thirds of the
    time."""
    valid_interval: int = 200
    max_tokens: int = 2048
    """Tokens per batch and rank."""
    compile: bool = False
    """Every training run compiles its Transformer layers (train.py ``--compile``)."""
    warmup_steps: int = 100
    """Fine-tuning warm-up of the inverse square-root schedule."""
    lr: float = 4e-3
    """Fine-tuning peak learning rate."""
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
    cl_epochs: int = 3
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
    procs: int = 2
    """Training processes on this machine (GPUs, or CPU processes)."""
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
            if key not in SYSTEMS and key not in ABLATIONS and key not in RELATED:
                known = ", ".join([*SYSTEMS, *ABLATIONS, *RELATED])
                raise ValueError(f"unknown system {key!r}; known: {known}")
        for setting in self.settings:
            if setting not in SETTINGS:
                raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
        names = ("pretrain_steps", "finetune_steps", "valid_interval", "procs", "train_pairs")
        for name in (*names, "ras_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.no_repeat_ngram_size is not None and self.no_repeat_ngram_size < 0:
            raise ValueError("--no-repeat-ngram-size must be >= 0 (0: no limit)")
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
        if "unsupervised" in self.settings:
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
        return UNSUPERVISED_NO_REPEAT_NGRAM if setting == "unsupervised" else 0

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
        return SYSTEMS.get(key) or ABLATIONS.get(key) or RELATED[key]


LANG_CODE = re.compile(r"[A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?(?:@[A-Za-z0-9]+)?")
"""A gettext language code, as the demo corpus reads them (de, pt_BR, sr@latin)."""


def parse_languages(text: str) -> tuple[str, ...]:
    """``--languages en,de,fr``: comma-separated codes (``PipelineConfig`` checks them)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


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


UNSUPERVISED_NO_REPEAT_NGRAM = 3
"""The unsupervised setting's ``--no-repeat-ngram-size`` unless one is given."""

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
    "study": {
        "workdir": Path("runs/study"),
        "systems": tuple(SYSTEMS),
        "settings": ("supervised",),
        "model_preset": "small",
        "pretrain_steps": 800,
        "finetune_steps": 1000,
        "valid_interval": 250,
        "lr": 2e-3,
        "denoise_schedule": "0:1,500:0.1,1000:0",
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
"""Named budgets: demo (the README's main command, 2 CPU cores: 25 minutes on the slower
machine on a slow day, less elsewhere; README), smoke (the test suite's reduced end-to-end
run), study (below) and paper (the paper's scale, on GPUs). A budget may name its systems
and settings; ``--systems`` and ``--settings`` override them.

study: the five systems of Table 3, supervised, in about three hours on the 2-core CPU
machine with 2 processes: the ``small`` model (d 128, 4+4 layers; see its docstring for why
not wider), 800 pre-training steps and 1,000 fine-tuning steps at a peak learning rate of
2e-3 (the demo's budget when the study's runs were measured: 400, 800 and 2e-3), the
demo's data, batches and pre-training learning rate otherwise. The arithmetic, from the
demo's measured rates on that machine (a slow day: 3,700 tokens/s for joint pre-training, 9,000 for
fine-tuning, about 4,400 tokens a step: 1.2 s and 0.49 s a step; XLM's encoder stage 0.23 of
a joint step, 0.27 s; mBART's denoising a fine-tuning-shaped step, 0.49 s) times the small
model's measured cost per step (2.3x tiny's for the joint stage, 2.0x for the others):

- a step: joint 2.7 s, fine-tuning 0.98 s, encoder stage 0.55 s, mBART 0.98 s;
- fine-tuning, every system: 1,000 x 0.98 s = 16 min;
- pre-training: XLM 800 x 0.55 s = 7 min, mBART 13 min, CL-SemFace and VQ-SemFace 36 min
  each;
- per system: Transformer 16 min, XLM 23, mBART 29, CL-SemFace 53, VQ-SemFace 53; together
  2 h 55 min, and about 10 minutes more for the data, the CL table, nine launches and
  the test translations: about 3 h 5 min. The machine kind runs up to 2x faster on a good
  day; ``--seeds 0,1,2`` takes three times as long."""
