"""The one training loop, for every stage.

Per step: one token-budget batch per rank (micro-batch), the stage's loss from its train
unit, backward and optimizer step through the DeepSpeed facade, skipped on every rank when
the loss is non-finite on any (nothing changes; ``Trainer._step``), the unit's work between
steps (validation), a stop-signal check agreed by all ranks, and checkpoints every
``save_interval`` steps and at the end. What differs per stage lives in its unit
(:mod:`megasemface.training.units`).

The host does not wait for the device within a step but in the optimizer's own overflow
check: the loss, its finiteness and the counters stay on the device
(:mod:`megasemface.training.step_ledger`) until a logging or checkpoint step reads them
(``tests/test_step_syncs.py`` counts the reads). Logging steps also report tokens/s per GPU,
model FLOPs utilisation and the memory peak (:mod:`megasemface.training.throughput`).

Exact resume: every random draw of a step is seeded from (seed, step, rank) and the loader
position is restored from the checkpoint, so a run resumed from checkpoint k repeats the
uninterrupted run's steps k+1... exactly in fp32. Resumed on another number of data-parallel
ranks, it goes on from the checkpoint's weights, optimizer state and place in the data order
(:mod:`megasemface.checkpoints.universal`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.checkpoints.consolidate import param_dtype
from megasemface.checkpoints.manager import CheckpointManager
from megasemface.checkpoints.universal import ResumePoint, resume_point
from megasemface.data.loading.loader import ShardLoader
from megasemface.distributed import collectives
from megasemface.distributed.collectives import any_rank
from megasemface.distributed.engine import DeepSpeedEngine, accelerator_device, loading_universal
from megasemface.distributed.groups import ParallelGroups
from megasemface.nn.compile import compile_layers
from megasemface.nn.cpu_speed import apply_cpu_speed
from megasemface.tracking.mlflow_tracker import MLflowTracker
from megasemface.tracking.tracker import NullTracker, Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.preflight import lr_schedule_of
from megasemface.training.run_data import RunData
from megasemface.training.schedules import inverse_sqrt_lr
from megasemface.training.signals import StopRequest
from megasemface.training.step_ledger import StepLedger, StepRecord
from megasemface.training.throughput import Throughput
from megasemface.training.units import build_unit
from megasemface.training.units.base import TrainUnit, rank_loader

__all__ = ["NonFiniteError", "Trainer", "build_loader"]

logger = logging.getLogger(__name__)

FLUSH_BEFORE_SAVE_S = 5.0
"""At most this long a checkpoint waits for the tracked metrics to reach the store."""

LEDGER_STEPS = 1000
"""Steps the ledger keeps on the device at most before it is read (a logging interval
longer than this reads it in between, so that it stays small)."""

STOP_CHECK_STEPS = 10
"""Ranks agree on a stop signal at least this often (and at every logging and checkpoint
step): the agreement is a collective read on the host, which on GPUs waits for the step's
work, so it is not made every step. One process decides alone, every step."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss."""


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)


def _seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # dropout
    return torch.Generator().manual_seed(seed)  # masking and noising


def build_loader(
    config: TrainConfig, data: RunData, unit: TrainUnit, groups: ParallelGroups
) -> ShardLoader:
    """The run's batches for this data-parallel rank, cropped and mixed as ``unit`` reads
    them."""
    return rank_loader(
        config,
        data,
        groups,
        max_len=unit.loader_max_len(),
        languages=unit.loader_languages(),
        pair_share=unit.loader_pair_share(),
    )


class Trainer:
    def __init__(self, config: TrainConfig, ds_config: dict[str, Any], groups: ParallelGroups):
        self.config = config
        self.groups = groups
        self.rank = collectives.rank()
        self.world = collectives.world_size()
        self.is_main = self.rank == 0
        config.output_dir.mkdir(parents=True, exist_ok=True)

        self.data = RunData.load(config)
        torch.manual_seed(config.seed)  # the model's initialisation
        self.unit = build_unit(config, self.data, groups)
        # Before compiling and the engine: the device is the one the engine moves it to.
        apply_cpu_speed(self.unit.model, accelerator_device())
        if config.compile:  # preflight refused it under ZeRO-3
            compile_layers(self.unit.model)
        self.checkpoints = CheckpointManager(config.output_dir, config.keep_last, self.rank)
        # Before the engine: another number of data-parallel ranks than the checkpoint's
        # needs an engine that loads DeepSpeed's universal form.
        self.resume_from = self._resume_point()
        universal = self.resume_from is not None and self.resume_from.universal
        self.engine = DeepSpeedEngine(
            self.unit.model,
            loading_universal(ds_config) if universal else ds_config,
            groups,
            self.unit.trainable(),
        )
        self.ds_config = ds_config
        self.lr_schedule = lr_schedule_of(config, ds_config)
        self.base_lr = config.lr if config.lr is not None else self.engine.lr
        self.optimizer_skips = self.engine.skips_non_finite_gradients
        """Whether the optimizer skips a step with non-finite gradients itself (``_step``)."""
        self.loader = build_loader(config, self.data, self.unit, groups)
        self.step = 0
        self.skips_in_row = 0
        self.skipped = 0
        self.samples_seen = 0
        self.run_id: str | None = None
        self._metrics_log: _JsonLines | None = None
        self._samples_log: _JsonLines | None = None
        self._loop_started = time.perf_counter()

    # Checkpoints --------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        """Run metadata; a collective under ZeRO-3 (the fingerprint gathers weights)."""
        unit_meta = self.unit.meta(self.engine)
        return {
            "stage": self.config.stage,
            "interface": unit_meta.pop("interface"),
            "model": self.unit.model_config.to_dict(),
            "languages": self.data.languages,
            "vocab_sha256": self.data.tokenizer.sha256,
            "mlflow_run_id": self.run_id,
            "parent_runs": self.unit.parent_runs,
            "train_config": self.config.to_dict(),
            **unit_meta,
        }

    def save(self) -> float:
        """Writes a checkpoint on all ranks; returns the seconds training was blocked."""
        started = time.perf_counter()
        meta = self._meta()
        client_state = {
            "step": self.step,
            "skipped": self.skipped,
            "samples_seen": self.samples_seen,
            "mlflow_run_id": self.run_id,
            "meta": meta,
            **self.unit.state_dict(),
        }
        rank_state = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            **self.unit.rank_state(),
            # Every step reseeds Python, numpy and torch from (seed, step, rank), so the step
            # number restores all random state; the scheme is recorded for audits.
            "rng": {"scheme": "per-step", "seed": self.config.seed, "rank": self.rank},
        }

        def write_engine(root: Path, tag: str) -> None:
            self.engine.save(root, tag, client_state)
            if self.is_main:
                (root / tag / "meta.json").write_text(json.dumps(meta, indent=1))

        self.checkpoints.save(self.step, write_engine, rank_state, collectives.barrier)
        return time.perf_counter() - started

    @staticmethod
    def _flush_tracker(tracker: Tracker) -> float:
        """Waits until the metrics logged so far are in the store; returns the seconds.

        Before a checkpoint counts as complete: a run killed after it and resumed from it
        restarts after the checkpoint's step, so anything of that step still queued would be
        lost from the record. Bounded, and skipped while the store is down, so that tracking
        still cannot stall training.
        """
        started = time.perf_counter()
        if tracker.reachable:
            tracker.flush(timeout=FLUSH_BEFORE_SAVE_S)
        return time.perf_counter() - started

    def _resume_point(self) -> ResumePoint | None:
        """The newest complete checkpoint, converted if the number of data-parallel ranks
        changed (a collective)."""
        newest = self.checkpoints.newest()
        if newest is None:
            return None
        return resume_point(
            self.checkpoints.root / newest[1],
            mp_size=self.groups.mp_size,
            mp_rank=self.groups.mp_rank,
            dp_size=self.groups.dp_size,
            dp_rank=self.groups.dp_rank,
            barrier=collectives.barrier,
        )

    def resume(self) -> bool:
        point = self.resume_from
        if point is None:
            return False
        client_state = self.engine.load(point.load_dir, point.tag)
        # Every rank's loader state: on another number of ranks, the slots this rank reads
        # now were read by others.
        states = self.checkpoints.rank_states(point.tag)
        self.loader.load_states([state["loader"] for state in states])
        self.unit.load_rank_states(states)
        self.step = int(client_state.get("step", point.step))
        self.skipped = int(client_state.get("skipped", 0))
        self.samples_seen = int(client_state.get("samples_seen", 0))
        self.run_id = client_state.get("mlflow_run_id")
        self.unit.load_state_dict(client_state)
        if self.is_main:
            change = ""
            if point.universal:
                change = (
                    f"; written by {point.written_dp_size} data-parallel ranks, continued on "
                    f"{self.groups.dp_size} from DeepSpeed's universal form in {point.load_dir}"
                )
            print(
                f"resuming from {self.checkpoints.root / point.tag} (step {self.step}){change}",
                flush=True,
            )
        return True

    # Loop ---------------------------------------------------------------------------------

    def _lr_at(self, step: int) -> float:
        """The learning rate of ``step`` for the schedules megasemface runs itself."""
        if self.lr_schedule == "constant":
            return self.base_lr
        return inverse_sqrt_lr(self.base_lr, self.config.warmup_steps, step)

    def _tracker(self) -> Tracker:
        cfg = self.config
        if not self.is_main or cfg.no_tracking:
            return NullTracker()
        tags = {"stage": cfg.stage, **self.unit.run_tags(), "git_commit": _git_commit()}
        tags.update({f"parent_{k}_run": v for k, v in self.unit.parent_runs.items() if v})
        tags.update(cfg.tag_dict())
        return MLflowTracker(
            cfg.tracking_uri,
            cfg.output_dir,
            cfg.experiment,
            cfg.run_name,
            run_id=self.run_id,
            tags=tags,
        )

    def run(self) -> int:
        cfg = self.config
        resumed = self.resume()
        tracker = self._tracker()
        self.run_id = tracker.run_id
        if self.is_main:
            resolved = {
                "train": cfg.to_dict(),
                "model": self.unit.model_config.to_dict(),
                "deepspeed": self.ds_config,
            }
            (cfg.output_dir / "config.json").write_text(json.dumps(resolved, indent=1))
            if not resumed:
                print(json.dumps(resolved, indent=1), flush=True)
                tracker.log_params(resolved)
                tracker.log_artifact(cfg.output_dir / "config.json")
                tracker.log_artifact(cfg.spm_model)
                tracker.log_dict(
                    {"manifest_fingerprint": self.data.manifest.raw["build_fingerprint"]},
                    "data.json",
                )
                manifest = self.data.manifest
                tracker.log_dataset(
                    f"shards/{manifest.root.name}",
                    manifest.raw["build_fingerprint"],
                    str(manifest.root.resolve()),
                    manifest.profile(),
                    "training",
                )
                # The dataset input gives the counts; how the loader draws batches from them
                # (the temperature and each language's resulting share) is the loader's.
                sampling = self.loader.sampling()
                tracker.log_dict(sampling, "sampling.json")
                loader = {
                    "temperature": sampling["temperature"],
                    "probability": {
                        lang: round(info["probability"], 6)
                        for lang, info in sampling["languages"].items()
                    },
                }
                if sampling["pair_share"] is not None:
                    loader["pair_share"] = sampling["pair_share"]
                tracker.log_params({"loader": loader})
        stop = StopRequest()
        status = "FAILED"
        try:
            status = self._loop(tracker, stop)
            if status == "FINISHED":
                self.unit.after_training(self.engine, tracker)
        finally:
            tracker.end(status)
        return 0

    def _loop(self, tracker: Tracker, stop: StopRequest) -> str:
        cfg = self.config
        self.engine.train()
        stream = iter(self.loader)
        self._samples_log = self._metrics_log = None
        if cfg.log_sample_ids:
            self._samples_log = _JsonLines(cfg.output_dir / f"samples-rank{self.rank:03d}.jsonl")
        if self.is_main:
            self._metrics_log = _JsonLines(cfg.output_dir / "metrics.jsonl")
        progress = _Progress(self.is_main, cfg.steps, self.step)
        ledger = StepLedger(self.engine.device, self.groups.mp_size)
        dtype = param_dtype(self.ds_config) or torch.float32
        speed = Throughput(self.engine.device, self.world, dtype)
        window = _Window()
        self._loop_started = window.started
        last: StepRecord | None = None
        status = "FINISHED"
        while self.step < cfg.steps:
            step = self.step + 1
            batch = next(stream)
            generator = _seed_everything(_step_seed(cfg.seed, step, self.groups.dp_rank))
            out = self.unit.loss(self.engine, batch, generator, step)
            loss = out.loss * float("nan") if step in cfg.inject_nan_at else out.loss
            self._step(loss, step)
            self.step = step
            ledger.add(
                step,
                loss,
                tokens=batch.num_tokens,
                sentences=len(batch.lengths),
                flops=self.unit.flops(out),
                time=time.perf_counter() - self._loop_started,
                sentence_ids=batch.sentence_ids.tolist() if cfg.log_sample_ids else None,
            )
            logging_step = step % cfg.log_interval == 0 or step == cfg.steps
            if logging_step or len(ledger) >= LEDGER_STEPS:
                last = self._settle(ledger, window)
            if logging_step:
                assert last is not None and last.step == step  # read just above
                elapsed = time.perf_counter() - window.started
                metrics = {name: float(v) for name, v in out.components.items()}
                metrics.update({name: float(v) for name, v in out.metrics.items()})
                metrics.update(self.unit.health(self.engine, step))
                metrics.update(
                    loss=last.loss_sum / self.world,
                    lr=self.engine.lr,
                    grad_norm=self.engine.grad_norm() or 0.0,
                    skipped_steps=self._skipped_steps(),
                    tokens_per_s=window.tokens / max(elapsed, 1e-9),
                    samples_seen=self.samples_seen,
                )
                metrics.update(speed.figures(window.tokens, window.flops, elapsed))
                tracker.log_metrics(metrics, step)
                progress.update(step, metrics, out.components, self.unit.health_fields(metrics))
                window = _Window()
            self.unit.after_step(self.engine, step, tracker)
            saving = step % cfg.save_interval == 0 or step == cfg.steps
            stopping = (
                self.world == 1 or logging_step or saving or step % STOP_CHECK_STEPS == 0
            ) and stop.agreed()
            if stopping or saving:
                self._settle(ledger, window)  # the counters a checkpoint keeps
                blocked = self._flush_tracker(tracker)
                # A store slow to start (a fresh SQLite database on a busy machine) creates
                # the run after training began: a checkpoint waits for it, once, to name it.
                self.run_id = self.run_id or tracker.wait_for_run()
                blocked += self.save()
                if self._metrics_log is not None:
                    self._metrics_log.write({"step": step, "checkpoint_seconds": blocked})
            if stopping:
                if self.is_main:
                    print(
                        f"\n{stop.signal_name or 'a signal on another rank'}: saved step "
                        f"{step} and stopping",
                        flush=True,
                    )
                status = "KILLED"
                break
        return status

    def _step(self, loss: torch.Tensor, step: int) -> None:
        """Backward and optimizer step, or nothing on every rank when the loss is non-finite
        on any rank.

        Where the optimizer's step skips itself on non-finite gradients on any rank (its
        overflow check, reduced over the ranks: ``engine.skips_non_finite_gradients``), the
        loop leaves the decision to it rather than reading the loss on the host: the loss is
        back-propagated times 1 where it is finite and times NaN where it is not, which makes
        every gradient it reaches NaN, so the step is skipped everywhere (no update; Adam's
        moments and step count and the learning-rate schedule untouched) with no host read
        but the check the optimizer makes anyway. Times 1 leaves the gradients bit for bit
        those of the loss. The ledger counts the skip when it is read. (Under fp16 the check
        also counts the skip as an overflow of the dynamic loss scale; with gradient
        accumulation the optimizer step the micro-batch belongs to is skipped.) Any other
        optimizer: the ranks agree on the host, every step, and skip the backward."""
        finite = torch.isfinite(loss.detach())
        if self.optimizer_skips:
            scale = torch.where(finite, 1.0, float("nan")).to(loss.dtype)
            self.engine.backward(loss * scale)
        elif any_rank(not bool(finite)):
            return
        else:
            self.engine.backward(loss)
        if self.lr_schedule != "deepspeed":
            self.engine.set_lr(self._lr_at(step))
        self.engine.step()

    def _skipped_steps(self) -> int:
        """Steps that changed nothing: a non-finite loss, or the optimizer's own overflow
        skips (fp16), which include the former where the optimizer made them."""
        if self.optimizer_skips:
            return self.engine.skipped_steps
        return self.skipped + self.engine.skipped_steps

    def _settle(self, ledger: StepLedger, window: _Window) -> StepRecord | None:
        """Reads the ledger's steps (a collective) into the counters, the window and the
        step logs; raises :class:`NonFiniteError` at the step that made too many non-finite
        losses in a row. Returns the last step's record (None: nothing since the last
        read)."""
        records = ledger.flush()
        for record in records:
            if record.skipped:
                self.skipped += 1
                self.skips_in_row += 1
                logger.warning(
                    "step %d: non-finite loss, step skipped (%d in a row)",
                    record.step,
                    self.skips_in_row,
                )
                if self.skips_in_row >= self.config.max_consecutive_skips:
                    if self._metrics_log is not None:
                        self._metrics_log.write(
                            {"step": record.step, "loss": record.loss_sum, "skipped": True}
                        )
                    raise NonFiniteError(
                        f"step {record.step}: the loss was non-finite {self.skips_in_row} "
                        "steps in a row; lower the learning rate, check the data, or resume "
                        "from an earlier checkpoint"
                    )
            else:
                self.skips_in_row = 0
            self.samples_seen += int(record.sentences)
            window.tokens += int(record.tokens)
            window.flops += record.flops
            if self._samples_log is not None:
                # With this rank's own loss: the samples are this rank's, the logged loss
                # is the mean over ranks.
                self._samples_log.write(
                    {"step": record.step, "ids": record.sentence_ids, "loss": record.own_loss}
                )
            if self._metrics_log is not None:
                self._metrics_log.write(
                    {
                        "step": record.step,
                        "loss": record.loss_sum / self.world,
                        "skipped": record.skipped,
                        "tokens": int(record.tokens),
                        "time": record.time,
                    }
                )
        return records[-1] if records else None


@dataclasses.dataclass
class _Window:
    """What the steps read since the last logging step did, summed over the ranks."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    tokens: int = 0
    flops: float = 0.0


class _JsonLines:
    """Appends one JSON object per line; opened per write so a kill loses at most one line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(obj) + "\n")


class _Progress:
    """One line on rank 0: step, tokens/s (all ranks, and per GPU with the model FLOPs
    utilisation and the memory peak), the loss and its parts, the unit's health fields,
    learning rate, ETA."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.enabled = enabled
        self.total = total
        self.start = start
        self.started = time.perf_counter()

    def update(
        self, step: int, metrics: dict[str, float], parts: Iterable[str], fields: list[str]
    ) -> None:
        """``parts``: the names of the loss's parts in ``metrics``; ``fields``: the unit's
        health fields (VQ-SemFace's code usage)."""
        if not self.enabled:
            return
        done = step - self.start
        rate = done / max(time.perf_counter() - self.started, 1e-9)
        eta = (self.total - step) / max(rate, 1e-9)
        losses = " ".join(f"{name}={metrics[name]:.3f}" for name in parts)
        health = "".join(f" | {field}" for field in fields)
        speed = ""
        if "tokens_per_s_per_gpu" in metrics:
            memory = (
                f"GPU mem {metrics['gpu_memory_peak_gib']:.1f} GiB"
                if "gpu_memory_peak_gib" in metrics
                else f"RSS {metrics['rss_peak_gib']:.1f} GiB"
            )
            # A field of its own after the tokens/s: tools read "step S/N | T tok/s | ...".
            speed = (
                f" | {metrics['tokens_per_s_per_gpu']:,.0f} tok/s/GPU MFU {metrics['mfu']:.1%} "
                f"{memory}"
            )
        print(
            f"step {step}/{self.total} | {metrics['tokens_per_s']:,.0f} tok/s{speed} | "
            f"loss {metrics['loss']:.3f} {losses}{health} | lr {metrics['lr']:.2e} | "
            f"ETA {eta:,.0f}s",
            file=sys.stdout,
            flush=True,
        )


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
