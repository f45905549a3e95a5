"""The training run's options: one typed config, built from the command line."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megasemface.interfaces.registry import (
    DECODER_CODES,
    DEFAULT,
    NONE,
    CrossLingualOptions,
    VQOptions,
    interface,
    interface_names,
    interface_option_sections,
)
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.objectives.options import DECODER_OBJECTIVES, PretrainingOptions
from megasemface.stages import finetune_mode, finetune_mode_names, stage, stage_names
from megasemface.training.fusion_options import parse_fusion_weights
from megasemface.training.interface_options import fill_interface_options
from megasemface.training.option_sections import (
    LR_SCHEDULES,
    DataOptions,
    FinetuneOptions,
    GenerationOptions,
    ModelOptions,
    OptimisationOptions,
    RunOptions,
    SubstitutionOptions,
    TrackingOptions,
    ValidationOptions,
)
from megasemface.training.schedules import parse_schedule

__all__ = [
    "TrainConfig",
    "add_train_arguments",
    "field_docs",
    "option_sections",
    "section_of",
    "train_argv",
    "train_config_from_args",
    "typed_overrides",
    "user_model_config",
    "user_model_keys",
]


# A dataclass lists its bases' fields from the last base to the first: the run's own come
# first. Each interface's section (its record's ``options``) is a base too, which
# tests/test_train_options.py checks.
@dataclasses.dataclass(kw_only=True)
class TrainConfig(
    VQOptions,
    CrossLingualOptions,
    PretrainingOptions,
    SubstitutionOptions,
    FinetuneOptions,
    GenerationOptions,
    ValidationOptions,
    TrackingOptions,
    OptimisationOptions,
    DataOptions,
    ModelOptions,
    RunOptions,
):
    """Everything a run needs besides the DeepSpeed config: the fields of its sections (the
    run's own, ``training/option_sections.py``; the pre-training losses'; each interface's),
    each defined once there, checked together here."""

    def __post_init__(self) -> None:
        run_stage = stage(self.stage)
        if run_stage.finetunes and interface(self.interface).semface and self.init_from is None:
            raise ValueError(
                f"--stage finetune --interface {self.interface} needs --init-from, the "
                f"connected {self.interface.upper()}-SemFace model directory "
                "(tools/merge_checkpoints.py connect); without it the model starts from random "
                "weights: that is the Transformer baseline, --interface none"
            )
        if not run_stage.semface:
            self.interface = NONE  # its model has no semantic interface
        run_interface = interface(self.interface)
        run_interface.check(self, run_stage)
        if self.lr_schedule not in (None, *LR_SCHEDULES):
            raise ValueError(f"--lr-schedule must be one of {LR_SCHEDULES}")
        mode = finetune_mode(self.finetune_mode)
        if not run_stage.splits_codebook and self.mp_size != 1:
            raise ValueError(f"--stage {self.stage} has no codebook to split: use --mp-size 1")
        self._check_ras()
        run_stage.check(self)
        if self.register_model is not None and (
            not run_stage.finetunes or self.valid_prefix is None or self.no_tracking
        ):
            raise ValueError(
                "--register-model registers the best model of fine-tuning: use it with "
                "--stage finetune and --valid-prefix, without --no-tracking"
            )
        if not 0 <= self.label_smoothing < 1:
            raise ValueError("--label-smoothing must be in [0, 1)")
        fill_interface_options(self)
        weights = ("mse_weight", "diversity_weight", "l2_weight", "commitment_weight")
        for name in (*weights, "token_entropy_weight"):  # < 0 would maximise its term
            if (getattr(self, name) or 0.0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        self.tag_dict()  # validates KEY=VALUE
        parse_fusion_weights(self.fusion_weights)
        for text in self.directions:
            src, sep, tgt = text.partition("-")
            if not (sep and src and tgt):
                raise ValueError(f"--direction takes SRC-TGT, got {text!r}")
        # Unsupervised: each rank's batch is in one language, and a language no direction
        # translates into has no back-translation, so its ranks would run other passes than
        # the rest (a collective mismatch under ZeRO-3) and none once denoising ends.
        targets = {text.partition("-")[2] for text in self.directions}
        if run_stage.finetunes and mode.monolingual and len(targets) == 1:
            raise ValueError(
                "unsupervised fine-tuning back-translates the batches of both languages: "
                "give --direction for both directions of the pair, or leave it out"
            )
        try:
            parse_schedule(self.denoise_schedule)
        except ValueError as exc:
            raise ValueError(f"--denoise-schedule: {exc}") from None
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError("--num-workers must be >= 0")
        if self.no_repeat_ngram_size < 0:
            raise ValueError("--no-repeat-ngram-size must be >= 0 (0: no limit)")
        if not 0 <= self.bt_min_len_a <= self.max_len_a:
            raise ValueError("--bt-min-len-a must be in [0, --max-len-a] (0: no minimum)")
        for name in (
            "steps",
            "save_interval",
            "keep_last",
            "log_interval",
            "mp_size",
            "warmup_steps",
            "valid_interval",
            "valid_max_sentences",
            "valid_beam",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    def _check_ras(self) -> None:
        """Random aligned substitution: where it runs, and that it has a dictionary."""
        run_stage = stage(self.stage)
        if not 0 <= self.ras_prob <= 1:
            raise ValueError("--ras-prob must be in [0, 1]")
        substitutes = finetune_mode(self.finetune_mode).substitutes
        if self.finetune_ras and not (run_stage.finetunes and substitutes):
            raise ValueError(
                "--finetune-ras substitutes the source side of parallel pairs: use it with "
                "--stage finetune --finetune-mode supervised"
            )
        if self.decoder_noise_ras and not (run_stage.decoder and interface(self.interface).semface):
            raise ValueError(
                "--decoder-noise-ras substitutes the SemFace decoder stage's noised copy: use it "
                "with --stage decoder or joint and --interface cl or vq"
            )
        uses = run_stage.substitutes or self.finetune_ras or self.decoder_noise_ras
        if uses and not self.ras_dictionary and (not run_stage.substitutes or self.ras_prob > 0):
            raise ValueError(
                "random aligned substitution needs --ras-dictionary <src>-<tgt>.tsv (a user's "
                "word list, or one tools/build_cl_embeddings.py --dictionary-out induces)"
            )
        if self.ras_dictionary and not uses:
            raise ValueError(
                "--ras-dictionary is read by --stage mrasp, --finetune-ras or "
                "--decoder-noise-ras; add one of them or leave it out"
            )

    def tag_dict(self) -> dict[str, str]:
        tags = {}
        for item in self.tags:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--tag takes KEY=VALUE, got {item!r}")
            tags[key.strip()] = value.strip()
        return tags

    def to_dict(self) -> dict[str, Any]:
        """JSON values: paths as strings, in lists too."""

        def plain(value: Any) -> Any:
            if isinstance(value, list):
                return [plain(item) for item in value]
            return str(value) if isinstance(value, Path) else value

        return {k: plain(v) for k, v in dataclasses.asdict(self).items()}


def field_docs() -> dict[str, str]:
    """Each TrainConfig field's docstring, one paragraph: the one text of its ``--help``
    line and of docs/options.md."""
    docs = {}
    for section in option_sections():
        (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(section))).body
        assert isinstance(class_def, ast.ClassDef)
        for field, doc in itertools.pairwise(class_def.body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
            ):
                docs[field.target.id] = " ".join(inspect.cleandoc(doc.value.value).split())
    return docs


_Section = typing.TypeVar("_Section")


def section_of(config: TrainConfig, section: type[_Section]) -> _Section:
    """The values ``config`` holds for one of its sections, as that section's dataclass."""
    fields = dataclasses.fields(section)  # type: ignore[arg-type]  # a section is a dataclass
    return section(**{f.name: getattr(config, f.name) for f in fields})


def option_sections() -> list[type]:
    """The dataclasses that define TrainConfig's fields: TrainConfig and the sections it
    holds, each field defined in one of them."""
    return [c for c in TrainConfig.__mro__ if dataclasses.is_dataclass(c)]


def _adder(group: Any, actions: list[argparse.Action], docs: dict[str, str]) -> Callable[..., None]:
    """``group.add_argument`` (of a parser or an argument group) that collects the actions
    in ``actions`` and, without a ``help``, takes the field's docstring from ``docs``."""

    def add(*flags: str, **kwargs: Any) -> None:
        dest = kwargs.get("dest") or flags[0].removeprefix("--").replace("-", "_")
        if "help" not in kwargs:
            default = kwargs.get("default")
            shown = not (default is None or isinstance(default, (bool, list)))
            if kwargs.get("action") == "append":
                note = " (repeatable)"
            elif shown and not kwargs.get("required"):
                note = " (default: %(default)s)"
            else:
                note = ""
            kwargs["help"] = docs[dest].replace("%", "%%") + note
        actions.append(group.add_argument(*flags, **kwargs))

    return add


def add_train_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Adds train.py's options to ``parser`` and returns them. An option's help is its
    TrainConfig field's docstring."""
    d = TrainConfig(
        stage="encoder", interface=DEFAULT, data=Path(), spm_model=Path(), output_dir=Path()
    )
    actions: list[argparse.Action] = []
    docs = field_docs()
    add = _adder(parser, actions, docs)
    # DeepSpeed's launcher appends --local_rank=R to the script's arguments, and torch's
    # launchers --local-rank=R: accepted by name. DeepSpeed reads the rank from LOCAL_RANK.
    add(
        "--local_rank",
        "--local-rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", -1)),
        help="set by the deepspeed launcher",
    )
    add("--stage", required=True, choices=stage_names())
    add("--interface", default=None, choices=interface_names())
    add("--data", type=Path, required=True)
    add("--spm-model", type=Path, required=True)
    add("--output-dir", type=Path, required=True)
    add("--preset", default=d.preset)
    add("--model", dest="model_options", action="append", default=[], metavar="KEY=VALUE")
    add("--model-config", dest="model_config_file", type=Path)
    for section in interface_option_sections():
        section.add_arguments(add)
    add("--init-from", type=Path)
    add("--decoder-objective", default=d.decoder_objective, choices=DECODER_OBJECTIVES)
    add("--mse-weight", type=float, default=d.mse_weight)
    add("--extractor-diversity", action="store_true")
    add("--decoder-codes", default=None, choices=DECODER_CODES)  # by stage: __post_init__
    add("--decoder-memory-norm", action=argparse.BooleanOptionalAction, default=None)  # by stage
    add("--decoder-continuous", type=float, default=None)  # by interface: __post_init__
    add("--decoder-word-drop", type=float, default=d.decoder_word_drop)
    add("--language-mean-weight", type=float, default=None)  # by interface: __post_init__
    add("--mp-size", type=int, default=d.mp_size)
    add("--steps", type=int, default=d.steps)
    add("--seed", type=int, default=d.seed)
    add("--max-tokens", type=int, default=d.max_tokens)
    add("--num-workers", type=int, default=d.num_workers)
    add("--compile", action="store_true")
    add("--save-interval", type=int, default=d.save_interval)
    add("--keep-last", type=int, default=d.keep_last)
    add("--log-interval", type=int, default=d.log_interval)
    add("--max-consecutive-skips", type=int, default=d.max_consecutive_skips)
    add("--experiment", default=d.experiment)
    add("--run-name")
    add("--tracking-uri")
    add("--no-tracking", action="store_true")
    add("--log-sample-ids", action="store_true")
    add("--tag", dest="tags", action="append", default=[], metavar="KEY=VALUE")
    add("--lr", type=float)
    add("--lr-schedule", choices=LR_SCHEDULES)
    add("--warmup-steps", type=int, default=d.warmup_steps)
    add = _adder(parser.add_argument_group("fine-tuning (--stage finetune)"), actions, docs)
    add("--finetune-mode", default=d.finetune_mode, choices=finetune_mode_names())
    add("--direction", dest="directions", action="append", default=[], metavar="SRC-TGT")
    add("--label-smoothing", type=float, default=d.label_smoothing)
    add("--fusion-weights", default=d.fusion_weights, metavar="T,TWP,TSP,MLM")
    add("--denoise-schedule", default=d.denoise_schedule, metavar="STEP:WEIGHT,...")
    add("--valid-prefix", type=Path, metavar="PREFIX")
    add("--valid-interval", type=int, default=d.valid_interval)
    add("--valid-max-sentences", type=int, default=d.valid_max_sentences)
    add("--valid-beam", type=int, default=d.valid_beam)
    add("--max-len-a", type=float, default=d.max_len_a)
    add("--max-len-b", type=int, default=d.max_len_b)
    add("--no-repeat-ngram-size", type=int, default=d.no_repeat_ngram_size)
    add("--bt-min-len-a", type=float, default=d.bt_min_len_a)
    add("--register-model", metavar="NAME")
    add = _adder(parser.add_argument_group("random aligned substitution (mRASP)"), actions, docs)
    add("--ras-dictionary", type=Path, action="append", default=[], metavar="SRC-TGT.tsv")
    add("--ras-prob", type=float, default=d.ras_prob)
    add("--finetune-ras", action="store_true")
    add("--decoder-noise-ras", action="store_true")
    add = _adder(parser, actions, docs)
    add("--inject-nan-at", type=int, action="append", default=[], metavar="STEP")
    return actions


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("interface") is None:  # not given: the stage's own
        values["interface"] = DEFAULT if stage(values["stage"]).semface else NONE
    return TrainConfig(**values)


def train_argv(config: TrainConfig) -> list[str]:
    """train.py's command line for ``config``, the inverse of :func:`train_config_from_args`:
    the required options and every value that differs from the option's default (a flag when
    true, a repeatable option once per item)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    argv: list[str] = []
    for action in add_train_arguments(argparse.ArgumentParser(add_help=False)):
        if action.dest not in names:
            continue  # --local_rank: the launcher's
        flag, value = action.option_strings[0], getattr(config, action.dest)
        if isinstance(value, bool):
            if value != _default(config, action):  # --x, or --no-x where on by default
                argv.append(flag if value else action.option_strings[-1])
        elif isinstance(value, list):
            argv += [text for item in value for text in (flag, str(item))]
        elif value is not None and (action.required or value != _default(config, action)):
            argv += [flag, str(value)]
    return argv


FILLED_IN = (
    "cl_trainable",
    "cl_unit_logits",
    "cl_unit_mse",
    "cl_table_input",
    "decoder_codes",
    "decoder_memory_norm",
    "decoder_continuous",
    "language_mean_weight",
)
"""TrainConfig fields that default to None, which ``__post_init__`` replaces with a value
chosen from the other fields."""


_GIVEN = object()  # a default no value equals: the option is always on the command line


def _default(config: TrainConfig, action: argparse.Action) -> object:
    """What ``config`` would hold without the option: its parser default, or what
    ``__post_init__`` fills in for this config (``FILLED_IN``)."""
    if action.dest in FILLED_IN:
        try:  # refused without it: the other options need this one as given
            return getattr(dataclasses.replace(config, **{action.dest: None}), action.dest)
        except ValueError:
            return _GIVEN
    return action.default


def _fits(value: object, hint: Any) -> bool:
    """``value`` has the type ``hint`` names (an int where a float is wanted too)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def typed_overrides(overrides: Mapping[str, object]) -> dict[str, Any]:
    """``overrides`` of TrainConfig fields by name, checked against the fields' types; an int
    given for a float field becomes a float.

    Raises:
        ValueError: naming an unknown field or a value of the wrong type.
    """
    hints = typing.get_type_hints(TrainConfig)
    written = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    checked: dict[str, Any] = {}
    for name, value in overrides.items():
        if name not in hints:
            raise ValueError(f"{name!r} is not a TrainConfig field (docs/options.md)")
        hint = hints[name]
        if not _fits(value, hint):
            raise ValueError(f"{name} takes {written[name]}, got {value!r}")
        if type(value) is int and (hint is float or float in typing.get_args(hint)):
            value = float(value)
        checked[name] = value
    return checked


def user_model_config(config: TrainConfig) -> ModelConfig:
    """The preset with the user's ``--model-config`` file and ``--model`` options, before
    the tokenizer's sizes are known (they replace the preset's placeholders)."""
    return build_model_config(
        config.preset, config.model_options, config_file=config.model_config_file
    )


def user_model_keys(config: TrainConfig) -> set[str]:
    """The model options the user set, in the ``--model-config`` file or with ``--model``."""
    keys = {option.partition("=")[0].strip() for option in config.model_options}
    if config.model_config_file is not None and config.model_config_file.is_file():
        data = json.loads(config.model_config_file.read_text(encoding="utf-8"))
        keys |= set(data) if isinstance(data, dict) else set()
    return keys
