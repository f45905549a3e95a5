"""Training-path benchmark: train.py through the launcher beside the bare model step.

Runs ``deepspeed megasemface/train.py`` (one process, CPU fp32 ZeRO-2, tiny preset, VQ joint
stage) on the demo corpus and reads its per-step log: training tokens/s of the full path
(loader, DeepSpeed engine, metrics, tracking) stands beside the bare model step measured in
this process on the same batches (forward, backward and Adam; no loader, no engine, no
logging), just before and just after the run; goal >= 0.9 of their mean. The bare step is
train.py's own model and loader (its unit and its trainer's ``build_loader``, with its
defaults), and the benchmark checks that the batches' token counts are the ones train.py
logged: the batches' shapes (sentences of the demo corpus's
lengths, their padding) weigh on a step's speed as much as the path around it. The time a
checkpoint blocks training is reported as a share of the wall time between checkpoints at the
default interval (500 steps); goal <= 1%.

Run: ``python benchmarks/bench_train.py [--steps 60] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megasemface.data.demo.demo_corpus import DEFAULT_LOCALE_DIR, build_demo_corpus
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path
from megasemface.distributed.groups import ParallelGroups
from megasemface.nn.cpu_speed import apply_cpu_speed, prepare_process
from megasemface.objectives.sequences import SequenceBatch
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.trainer import build_loader
from megasemface.training.units import build_unit
from megasemface.training.units.base import TrainUnit

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SAVE_INTERVAL = 500
WARMUP_STEPS = 6
"""Steps left out of both figures: start-up and the first allocations."""


def _prepare(work: Path, locale_dir: Path) -> tuple[Path, Path]:
    corpus = work / "corpus"
    build_demo_corpus(locale_dir, ["de"], corpus)
    mono = [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    prefix = work / "spm" / "joint"
    train_spm(parse_lang_path(mono), prefix, SpmTrainConfig(vocab_size=8000, num_threads=1))
    shards = work / "shards"
    config = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8)
    build_shards(parse_lang_path(mono), prefix.with_suffix(".model"), shards, config)
    return shards, prefix.with_suffix(".model")


def _train(shards: Path, model: Path, out: Path, steps: int, max_tokens: int) -> list[dict]:
    cmd = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_accelerators",
        "1",
        str(ROOT / "megasemface" / "train.py"),
        "--deepspeed_config",
        str(ROOT / "ds_configs" / "cpu_fp32_zero2.json"),
        "--stage",
        "joint",
        "--interface",
        "vq",
        "--data",
        str(shards),
        "--spm-model",
        str(model),
        "--output-dir",
        str(out),
        "--steps",
        str(steps),
        "--save-interval",
        str(steps // 2),
        "--max-tokens",
        str(max_tokens),
        "--log-interval",
        "10",
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_config(shards: Path, spm_model: Path, max_tokens: int) -> TrainConfig:
    """``train.py --stage joint --interface vq`` with its defaults, as ``_train`` runs it."""
    return TrainConfig(
        stage="joint",
        interface="vq",
        data=shards,
        spm_model=spm_model,
        output_dir=Path(),
        max_tokens=max_tokens,
    )


def _unit(config: TrainConfig) -> TrainUnit:
    """train.py's unit of one process: its model, as its trainer initialises it."""
    torch.manual_seed(config.seed)
    unit = build_unit(config, RunData.load(config), ParallelGroups.single())
    apply_cpu_speed(unit.model, "cpu")  # as the trainer does on a CPU
    return unit


def _loader_batches(config: TrainConfig, count: int) -> list[SequenceBatch]:
    """The first ``count`` batches of ``config``'s run: its trainer's loader and unit."""
    unit = _unit(config)
    loader = build_loader(config, unit.data, unit, ParallelGroups.single())
    return [unit.sequence_batch(b) for b in itertools.islice(iter(loader), count)]


def _bare_step_tokens_per_s(config: TrainConfig, batches: list[SequenceBatch]) -> float:
    """Tokens/s of the bare model step (forward, backward, Adam) over ``batches``, the first
    ``WARMUP_STEPS`` left out as train.py's are."""
    unit = _unit(config)
    optimizer = torch.optim.Adam(unit.trainable(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    started = 0.0
    for i, batch in enumerate(batches):
        if i == WARMUP_STEPS:
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        unit.model(batch, g).loss.backward()
        optimizer.step()
    tokens = sum(int(b.lengths_B.sum()) for b in batches[WARMUP_STEPS:])
    return tokens / (time.perf_counter() - started)


def run(steps: int, locale_dir: Path, max_tokens: int = 2048) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        shards, spm_model = _prepare(work, locale_dir)
        config = _train_config(shards, spm_model, max_tokens)
        batches = _loader_batches(config, steps)
        # The bare step is measured just before and just after train.py, and the run is
        # compared with their mean: load from other processes shifts both alike.
        before = _bare_step_tokens_per_s(config, batches)
        records = _train(shards, spm_model, work / "run", steps, max_tokens)
        after = _bare_step_tokens_per_s(config, batches)
        bare = (before + after) / 2
    steps_log = [r for r in records if "loss" in r]
    logged = [r["tokens"] for r in steps_log]
    counted = [int(b.lengths_B.sum()) for b in batches]
    if logged != counted:
        raise RuntimeError(
            "the bare step's batches are not train.py's (token counts per step "
            f"{counted[:5]}... against {logged[:5]}...): _train_config no longer matches "
            "_train's command line"
        )
    saves = [r["checkpoint_seconds"] for r in records if "checkpoint_seconds" in r]
    # From the end of the last warm-up step: the same steps as the bare figure.
    measured = steps_log[WARMUP_STEPS - 1 :]
    seconds = measured[-1]["time"] - measured[0]["time"]
    tokens = sum(r["tokens"] for r in measured[1:])
    step_time = seconds / (len(measured) - 1)
    stall = statistics.median(saves)
    return {
        "train_tokens_per_s": tokens / seconds,
        "bare_tokens_per_s": bare,
        "bare_before_after": [before, after],
        "ratio": tokens / seconds / bare,
        "checkpoint_seconds": stall,
        "step_seconds": step_time,
        "checkpoint_share": stall / (stall + DEFAULT_SAVE_INTERVAL * step_time),
    }


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "| figure | measured | limit or goal |",
            "|---|---|---|",
            f"| train.py training, tiny preset, VQ joint | {r['train_tokens_per_s']:,.0f} "
            f"tokens/s = {r['ratio']:.2f} of the bare step | bare model step on the same batches "
            f"{r['bare_tokens_per_s']:,.0f} tokens/s (before / after the run: "
            f"{r['bare_before_after'][0]:,.0f} / {r['bare_before_after'][1]:,.0f}); "
            "goal >= 0.90 |",
            f"| checkpoint stall | {r['checkpoint_seconds'] * 1e3:,.0f} ms per save = "
            f"{r['checkpoint_share']:.2%} of wall time at one save per "
            f"{DEFAULT_SAVE_INTERVAL} steps ({r['step_seconds'] * 1e3:,.0f} ms/step) | <= 1% |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--locale-dir", type=Path, default=Path(DEFAULT_LOCALE_DIR))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps must be above {WARMUP_STEPS + 1} (the warm-up steps and one)")
    prepare_process()  # as train.py and translate.py run
    results = run(args.steps, args.locale_dir)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
