"""The paper's comparison on one language pair, under one budget.

Runs Transformer (no pre-training), XLM-style, mBART-style, CL-SemFace and VQ-SemFace
pre-training, connects, fine-tunes each (low-resource supervised and unsupervised), scores
the test set, logs everything to one MLflow experiment and prints tables shaped like the
paper's Tables 3 and 4. Table 5's ablations are systems too (``--systems ablations``).

Examples::

    python tools/reproduce.py                      # demo budget, CPU, the demo corpus
    python tools/reproduce.py --systems vq,vq-no-div,vq-no-l2,vq-mlm --settings supervised
    python tools/reproduce.py --settings supervised --seeds 0,1,2  # mean ± std, p-values
    python tools/reproduce.py --systems transformer,mbart,cl,vq,related --settings supervised
    python tools/reproduce.py --languages en,de,fr,ro --settings supervised  # one pre-training
    python tools/reproduce.py --budget paper --corpus data/en-ro --pair en-ro \\
        --hostfile hostfile --deepspeed-config ds_configs/zero2_bf16.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from megasemface.cli.parsing import CommandParser
from megasemface.pipeline.config import (
    BUDGETS,
    PipelineConfig,
    parse_finetune_grid,
    parse_languages,
    parse_seeds,
)
from megasemface.pipeline.settings import SETTINGS
from megasemface.pipeline.systems import ABLATIONS, PAPER_SCALE, RELATED, SYSTEMS

__all__ = ["build_parser", "config_from_args", "main", "run"]


def build_parser(
    description: str, systems: str = "paper", settings: str = "supervised,unsupervised"
) -> argparse.ArgumentParser:
    parser = CommandParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--budget",
        default="demo",
        choices=sorted(BUDGETS),
        help="steps, data and model sizes (default: demo)",
    )
    add("--model-preset", help="model shapes: tiny, small or paper (default: the budget's)")
    add("--workdir", type=Path, help="where everything is built (default: runs/<budget>)")
    add(
        "--pair",
        default="en-de",
        help="language pair en-xx (default: en-de; another pair's work directory is "
        "runs/<budget>-<pair>)",
    )
    add(
        "--languages",
        help="several languages, English first, e.g. en,de,fr,ro: one pre-training per system "
        "over all of them, then fine-tuning and test of every pair en-xx from it, in one "
        "table (instead of --pair; supervised; default work directory runs/<budget>-<languages>)",
    )
    add("--locale-dir", type=Path, help="gettext catalogs of the demo corpus")
    add(
        "--doc-root",
        type=Path,
        help="where Debian's documentation packages are installed, whose text the demo corpus "
        "adds (default: /usr/share; a directory without them: the catalogs alone)",
    )
    add("--corpus", type=Path, help="a corpus in the demo corpus layout instead of the demo")
    add(
        "--systems",
        help=f"comma-separated, or 'paper' ({','.join(SYSTEMS)}), 'ablations' "
        f"({','.join(ABLATIONS)}), 'paper-scale' ({','.join(PAPER_SCALE)}) or 'related' "
        f"({','.join(RELATED)}); default: the "
        f"budget's, else {systems}",
    )
    add(
        "--settings",
        help=f"comma-separated of {','.join(SETTINGS)}; default: the budget's, else {settings}",
    )
    # Without --systems/--settings a budget's own (study) apply, else this entry point's.
    parser.set_defaults(entry_systems=systems, entry_settings=settings)
    add("--model", dest="model_options", action="append", default=[], metavar="KEY=VALUE")
    for name in (
        "vocab_size",
        "train_pairs",
        "test_sentences",
        "valid_sentences",
        "pretrain_steps",
        "finetune_steps",
        "valid_interval",
        "max_tokens",
        "warmup_steps",
        "beam",
        "no_repeat_ngram_size",
        "procs",
        "shard_jobs",
        "seed",
    ):
        add(f"--{name.replace('_', '-')}", type=int, dest=name)
    add(
        "--seeds",
        help="comma-separated seeds, e.g. 0,1,2: every system is trained and tested once per "
        "seed, the tables show mean ± std and sacreBLEU's paired bootstrap p-values "
        "(default: --seed; the data is built once, with --seed)",
    )
    add(
        "--compile",
        action="store_true",
        default=None,
        help="every training run compiles its Transformer layers (train.py --compile)",
    )
    add("--lr", type=float, help="fine-tuning peak learning rate")
    add(
        "--finetune-grid",
        help="fine-tuning settings tried per system and seed, LR or LR:WARMUP, comma-separated "
        "(e.g. 1e-3:400,2e-3:100,4e-3:100): the one with the highest validation BLEU is "
        "tested (default: the budget's, else --lr with --warmup-steps alone)",
    )
    add("--pretrain-lr", type=float, help="pre-training learning rate")
    add("--denoise-schedule")
    add("--deepspeed-config", type=Path)
    add("--hostfile", type=Path, help="DeepSpeed hostfile for multi-node runs")
    add("--experiment", help="MLflow experiment (default: megasemface-<pair>)")
    add(
        "--tracking-uri",
        help="MLflow store of every run, e.g. an mlflow server's http://mlflow-host:5000 "
        "(default: sqlite:///<workdir>/mlflow.db)",
    )
    add(
        "--ras-dictionary",
        type=Path,
        help="word dictionary <src>-<tgt>.tsv of random aligned substitution (mRASP, the RAS "
        "ablations); default: induced from the cross-lingual embeddings",
    )
    add("--ras-min-score", type=float, help="the induced dictionary's CSLS threshold")
    add("--ras-words", type=int, help="most frequent words of each language it translates")
    return parser


def _systems(text: str) -> tuple[str, ...]:
    keys: list[str] = []
    for item in text.split(","):
        item = item.strip()
        groups = {
            "paper": SYSTEMS,
            "ablations": ABLATIONS,
            "paper-scale": PAPER_SCALE,
            "related": RELATED,
        }
        keys += list(groups.get(item, [item]))
    return tuple(dict.fromkeys(k for k in keys if k))


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    budget = BUDGETS[args.budget]
    values: dict[str, object] = dict(budget)
    values.setdefault("workdir", Path("runs") / args.budget)
    omitted = {"systems", "settings", "seeds", "languages", "finetune_grid"}
    names = {f.name for f in dataclasses.fields(PipelineConfig)} - omitted
    for name, value in vars(args).items():
        if name in names and value not in (None, []):
            values[name] = value
    # The options, else the budget's own systems and settings (study), else the entry point's.
    own = {
        key: ",".join(typing.cast(tuple[str, ...], budget.get(key, ())))
        for key in ("systems", "settings")
    }
    values["systems"] = _systems(args.systems or own["systems"] or args.entry_systems)
    settings = args.settings or own["settings"] or args.entry_settings
    if args.languages is not None and not args.settings:
        settings = "supervised"  # each pair is fine-tuned supervised only
    values["settings"] = tuple(s.strip() for s in settings.split(",") if s.strip())
    values["model_options"] = tuple(args.model_options)
    if args.seeds is not None:
        values["seeds"] = parse_seeds(args.seeds)
    if args.finetune_grid is not None:
        values["finetune_grid"] = parse_finetune_grid(args.finetune_grid)
    elif args.lr is not None or args.warmup_steps is not None:
        values["finetune_grid"] = ()  # the setting asked for, not the budget's grid
    budget_dir = typing.cast(Path, values["workdir"])
    if args.languages is not None:
        values["languages"] = parse_languages(args.languages)
        if args.workdir is None:  # its own, beside (never inside) a single pair's
            values["workdir"] = budget_dir.with_name(
                f"{budget_dir.name}-{'-'.join(values['languages'])}"  # type: ignore[arg-type]
            )
    elif args.workdir is None and args.pair not in (None, PipelineConfig.pair):
        # Another pair's corpus, tokenizer and runs beside (never over) the default pair's.
        values["workdir"] = budget_dir.with_name(f"{budget_dir.name}-{args.pair}")
    return PipelineConfig(**values)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    from megasemface.data.demo.demo_corpus import DemoCorpusError
    from megasemface.nn import cpu_gemm
    from megasemface.nn.cpu_speed import prepare_process
    from megasemface.pipeline.launcher import LaunchError
    from megasemface.pipeline.pipeline import Pipeline

    prepare_process()  # for the test translations, which run in this process
    try:
        cpu_gemm.check_setting()  # before the data steps, not at the first training launch
        config = config_from_args(args)
        if config.multilingual and args.corpus is None:  # before anything is built
            config.check_catalogs()
        Pipeline(config, corpus=args.corpus).run()
    except (DemoCorpusError, LaunchError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(__doc__).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
