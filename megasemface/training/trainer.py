"""The training loop shared by every pre-training stage.

Per step: one token-budget batch per rank (micro-batch), the stage's loss, a check that the
loss is finite on every rank (if not, the step is skipped everywhere and nothing changes),
backward and optimizer step through the DeepSpeed facade, metrics, a stop-signal check
agreed by all ranks, and checkpoints every ``save_interval`` steps and at the end.

Exact resume: every random draw of a step is seeded from (seed, step, rank) and the loader
position is restored from the checkpoint, so a run resumed from checkpoint k repeats the
uninterrupted run's steps k+1... exactly in fp32.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megasemface.data.loader import LoaderConfig, ShardLoader, ShardSource, TokenBatch
from megasemface.data.shard_format import Manifest
from megasemface.data.tokenizer import Tokenizer
from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.factory import build_interface
from megasemface.models.config import ModelConfig, build_model_config
from megasemface.objectives.noising import sentence_boundary_ids
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.objectives.stages import (
    DenoisingSeq2Seq,
    ObjectiveConfig,
    SemFaceModel,
    StageOutput,
)
from megasemface.tracking.mlflow_tracker import MLflowTracker
from megasemface.tracking.tracker import NullTracker, Tracker
from megasemface.training.checkpoint import CheckpointManager
from megasemface.training.engine import DeepSpeedEngine
from megasemface.training.options import TrainConfig
from megasemface.training.signals import StopRequest

__all__ = ["NonFiniteError", "Trainer"]

logger = logging.getLogger(__name__)

FLUSH_BEFORE_SAVE_S = 5.0
"""At most this long a checkpoint waits for the tracked metrics to reach the store."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss."""


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)


def _seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # dropout
    return torch.Generator().manual_seed(seed)  # masking and noising


def _all_reduce(values: list[float], op: str = "sum") -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


class Trainer:
    def __init__(self, config: TrainConfig, ds_config: dict[str, Any], groups: ParallelGroups):
        self.config = config
        self.groups = groups
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.is_main = self.rank == 0
        config.output_dir.mkdir(parents=True, exist_ok=True)

        self.manifest = Manifest.load(config.data)
        self.tokenizer = Tokenizer.load(config.spm_model)
        if self.tokenizer.sha256 != self.manifest.spm_sha256:
            raise ValueError(
                f"{config.spm_model} is not the SentencePiece model the shards in {config.data} "
                "were built with (sha256 differs); pass the model given to build_shards"
            )
        self.languages = self.tokenizer.languages
        self.pairs: dict[str, tuple[str, str]] = dict(self.manifest.pairs)
        self._check_data()
        self.special = SpecialTokens.from_tokenizer(self.tokenizer)
        self.parent_runs: dict[str, str] = {}
        self.model_config = self._model_config()
        torch.manual_seed(config.seed)
        self.model, trainable = self._build_model(self.model_config)
        self.engine = DeepSpeedEngine(self.model, ds_config, groups, trainable)
        self.ds_config = ds_config
        self.lr_schedule = config.lr_schedule or (
            "inverse_sqrt" if config.stage == "finetune" else "deepspeed"
        )
        if self.lr_schedule != "deepspeed" and ds_config.get("scheduler"):
            raise ValueError(
                f"--lr-schedule {self.lr_schedule} replaces DeepSpeed's scheduler; remove "
                "'scheduler' from the DeepSpeed config or pass --lr-schedule deepspeed"
            )
        self.base_lr = config.lr if config.lr is not None else self.engine.lr
        if self.lr_schedule == "deepspeed" and config.lr is not None:
            if ds_config.get("scheduler"):
                raise ValueError("--lr would fight the DeepSpeed config's scheduler; set it there")
            self.lr_schedule = "constant"  # --lr replaces the config's optimizer lr
        self.checkpoints = CheckpointManager(config.output_dir, config.keep_last, self.rank)
        self.loader = ShardLoader(
            ShardSource.from_manifest(self.manifest),
            LoaderConfig(
                max_tokens=config.max_tokens,
                max_len=self._loader_max_len(),
                seed=config.seed,
                num_workers=config.num_workers,
            ),
            pad_id=self.tokenizer.pad_id,
            rank=groups.dp_rank,
            world_size=groups.dp_size,
        )
        self.step = 0
        self.skips_in_row = 0
        self.skipped = 0
        self.samples_seen = 0
        self.run_id: str | None = None

    # Model --------------------------------------------------------------------------------

    def _check_data(self) -> None:
        data_langs = {lang for pair in self.pairs.values() for lang in pair}
        data_langs |= set(self.manifest.languages) - set(self.pairs)
        missing = sorted(data_langs - set(self.languages))
        if missing:
            raise ValueError(f"the tokenizer has no language tag for {missing}")
        if self.pairs:
            raise ValueError(
                f"{self.config.data} holds parallel data ({sorted(self.pairs)}); pre-training "
                "stages read monolingual shards (parallel shards are for --stage finetune)"
            )

    def _model_config(self) -> ModelConfig:
        return build_model_config(
            self.config.preset,
            [*self._tokenizer_options(), *self.config.model_options],
            config_file=self.config.model_config_file,
        )

    def _tokenizer_options(self) -> list[str]:
        return [
            f"vocab_size={self.tokenizer.vocab_size}",
            f"num_langs={len(self.languages)}",
            f"pad_id={self.tokenizer.pad_id}",
            f"mask_id={self.tokenizer.mask_id}",
        ]

    def _loader_max_len(self) -> int:
        return self.model_config.max_len - 2  # room for </s> and the language tag

    def _build_model(
        self, model_config: ModelConfig
    ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        cfg = self.config
        objective = ObjectiveConfig(
            decoder_objective=cfg.decoder_objective,
            mse_weight=cfg.mse_weight,
            diversity_weight=cfg.diversity_weight,
            l2_weight=cfg.l2_weight,
            commitment_weight=cfg.commitment_weight,
            token_entropy_weight=cfg.token_entropy_weight,
            extractor_diversity=cfg.extractor_diversity,
        )
        if cfg.stage == "mbart":
            pieces = [self.tokenizer.processor.id_to_piece(i) for i in range(len(self.tokenizer))]
            model = DenoisingSeq2Seq(
                model_config, self.special, objective, tuple(sentence_boundary_ids(pieces))
            )
            return model, list(model.parameters())
        interface = build_interface(
            cfg.interface,
            model_config,
            groups=self.groups,
            seed=cfg.seed,
            cl_table=cfg.cl_table,
            cl_trainable=cfg.cl_trainable,
        )
        semface = SemFaceModel(model_config, interface, self.special, objective)
        if cfg.stage == "decoder" and cfg.interface == "vq":
            self._load_codebook(semface, cfg.init_from)
        semface.stage = cfg.stage  # type: ignore[assignment]
        if cfg.stage == "encoder":
            keep = semface.encoder_stage_parameters()
        elif cfg.stage == "decoder":
            keep = semface.decoder_stage_parameters()
        else:
            keep = semface.encoder_stage_parameters() + semface.decoder_stage_parameters()
        # Everything a stage does not train is frozen and kept out of the optimizer.
        kept = {id(p) for p in keep}
        for param in semface.parameters():
            if id(param) not in kept:
                param.requires_grad_(False)
        return semface, [p for p in keep if p.requires_grad]

    def _load_codebook(self, model: SemFaceModel, source: Path | None) -> None:
        """The frozen VQ layer of an encoder-stage run, cut for this model-parallel rank."""
        from megasemface.checkpoints import load_codebook

        assert source is not None
        codebook = load_codebook(source)  # a run, a checkpoint or a pretraining model dir
        if codebook.meta.get("vocab_sha256") != self.tokenizer.sha256:
            raise ValueError(f"{source} was trained with another SentencePiece model")
        quantizer = model.interface.quantizer  # type: ignore[union-attr]
        quantizer.load_state_dict(codebook.for_rank(self.groups.mp_rank, self.groups.mp_size))
        quantizer.freeze()
        self.parent_runs["encoder"] = codebook.meta.get("mlflow_run_id") or ""

    # Checkpoints --------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        """Run metadata; a collective under ZeRO-3 (the fingerprint gathers weights)."""
        interface = getattr(self.engine.module, "interface", None)
        fingerprint = {"kind": self.config.stage}  # mbart, finetune: no interface
        if interface is not None:
            with self.engine.gathered(interface.parameters()):
                fingerprint = interface.fingerprint()
        return {
            "stage": self.config.stage,
            "interface": fingerprint,
            "model": self.model_config.to_dict(),
            "languages": self.languages,
            "vocab_sha256": self.tokenizer.sha256,
            "mlflow_run_id": self.run_id,
            "parent_runs": self.parent_runs,
            "train_config": self.config.to_dict(),
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
            **self._extra_state(),
        }
        rank_state = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            # Every step reseeds Python, numpy and torch from (seed, step, rank), so the step
            # number restores all random state; the scheme is recorded for audits.
            "rng": {"scheme": "per-step", "seed": self.config.seed, "rank": self.rank},
        }

        def write_engine(root: Path, tag: str) -> None:
            self.engine.save(root, tag, client_state)
            if self.is_main:
                (root / tag / "meta.json").write_text(json.dumps(meta, indent=1))

        self.checkpoints.save(self.step, write_engine, rank_state, dist.barrier)
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

    def resume(self) -> bool:
        newest = self.checkpoints.newest()
        if newest is None:
            return False
        step, tag = newest
        client_state = self.engine.load(self.checkpoints.root, tag)
        rank_state = self.checkpoints.rank_state(tag)
        self.loader.load_state_dict(rank_state["loader"])
        self.step = int(client_state.get("step", step))
        self.skipped = int(client_state.get("skipped", 0))
        self.samples_seen = int(client_state.get("samples_seen", 0))
        self.run_id = client_state.get("mlflow_run_id")
        self._restore_extra_state(client_state)
        if self.is_main:
            print(f"resuming from {self.checkpoints.root / tag} (step {self.step})", flush=True)
        return True

    # Loop ---------------------------------------------------------------------------------

    def _sequence_batch(self, batch: TokenBatch) -> SequenceBatch:
        lang = self.languages.index(batch.lang)
        return SequenceBatch(batch.tokens, batch.lengths, torch.full_like(batch.lengths, lang))

    def _forward(self, batch: TokenBatch, generator: torch.Generator, step: int) -> StageOutput:
        """The step's loss (a subclass hook: fine-tuning builds its batches differently)."""
        interface = getattr(self.engine.module, "interface", None)
        if hasattr(interface, "set_step"):
            interface.set_step(step)
        return self.engine.forward(self._sequence_batch(batch), generator)

    def _interface_health(self, step: int) -> dict[str, float]:
        """The interface's health over the logging window (a collective on every rank), with
        a warning on rank 0 when a VQ codebook's argmax falls into a few codes."""
        interface = getattr(self.engine.module, "interface", None)
        if interface is None:
            return {}
        figures = interface.health()
        for prefix, part in (("vq_", "encoder"), ("dec_vq_", "decoder-stage extractor")):
            if f"{prefix}codes_used" not in figures or not self.is_main:
                continue
            used, tokens = figures[f"{prefix}codes_used"], figures[f"{prefix}tokens"]
            codes = used + figures[f"{prefix}dead_codes"]
            if used < self.config.codebook_warn_fraction * min(codes, tokens):
                print(
                    f"warning: step {step}: the {part} picked {used:.0f} of {codes:.0f} VQ codes "
                    f"for {tokens:.0f} tokens since the last log (histogram perplexity "
                    f"{figures[f'{prefix}code_perplexity']:.1f}): the codebook is collapsing; "
                    "raise --diversity-weight or check --model vq.diversity_loss",
                    flush=True,
                )
        return figures

    def _after_step(self, step: int, tracker: Tracker) -> None:
        """Runs on every rank after each step, before any checkpoint (validation hooks)."""

    def _extra_state(self) -> dict[str, Any]:
        """Stage-specific counters saved in checkpoints."""
        return {}

    def _restore_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _lr_at(self, step: int) -> float:
        """``--lr-schedule inverse_sqrt``: linear warm-up, then decay with 1/sqrt(step) (the
        paper's fine-tuning schedule); a pure function of the step, so resume is exact."""
        if self.lr_schedule == "constant":
            return self.base_lr
        warmup = self.config.warmup_steps
        return self.base_lr * min(step / warmup, math.sqrt(warmup / step))

    def _tracker(self) -> Tracker:
        cfg = self.config
        if not self.is_main or cfg.no_tracking:
            return NullTracker()
        tags = {"stage": cfg.stage, "interface": cfg.interface, "git_commit": _git_commit()}
        tags.update({f"parent_{k}_run": v for k, v in self.parent_runs.items() if v})
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
                "model": self.model_config.to_dict(),
                "deepspeed": self.ds_config,
            }
            (cfg.output_dir / "config.json").write_text(json.dumps(resolved, indent=1))
            if not resumed:
                print(json.dumps(resolved, indent=1), flush=True)
                tracker.log_params(resolved)
                tracker.log_artifact(cfg.output_dir / "config.json")
                tracker.log_artifact(cfg.spm_model)
                tracker.log_dict(
                    {"manifest_fingerprint": self.manifest.raw["build_fingerprint"]}, "data.json"
                )
        stop = StopRequest()
        status = "FAILED"
        try:
            status = self._loop(tracker, stop)
        finally:
            tracker.end(status)
        return 0

    def _loop(self, tracker: Tracker, stop: StopRequest) -> str:
        cfg = self.config
        self.engine.train()
        stream = iter(self.loader)
        samples_log = metrics_log = None
        if cfg.log_sample_ids:
            samples_log = _JsonLines(cfg.output_dir / f"samples-rank{self.rank:03d}.jsonl")
        if self.is_main:
            metrics_log = _JsonLines(cfg.output_dir / "metrics.jsonl")
        progress = _Progress(self.is_main, cfg.steps, self.step)
        window_tokens, window_started = 0, time.perf_counter()
        loop_started = window_started
        status = "FINISHED"
        while self.step < cfg.steps:
            step = self.step + 1
            batch = next(stream)
            generator = _seed_everything(_step_seed(cfg.seed, step, self.groups.dp_rank))
            out = self._forward(batch, generator, step)
            loss = out.loss * float("nan") if step in cfg.inject_nan_at else out.loss
            bad, loss_sum, tokens, sentences = _all_reduce(
                [
                    0.0 if math.isfinite(loss.item()) else 1.0,
                    loss.item(),
                    batch.num_tokens,
                    len(batch.lengths),
                ]
            )
            if bad:
                # Skipped on every rank: no backward, no optimizer step, nothing changes.
                self.skipped += 1
                self.skips_in_row += 1
                logger.warning(
                    "step %d: non-finite loss, step skipped (%d in a row)", step, self.skips_in_row
                )
                if self.skips_in_row >= cfg.max_consecutive_skips:
                    if metrics_log is not None:
                        metrics_log.write({"step": step, "loss": loss_sum, "skipped": True})
                    raise NonFiniteError(
                        f"step {step}: the loss was non-finite {self.skips_in_row} steps in a "
                        "row; lower the learning rate, check the data, or resume from an "
                        "earlier checkpoint"
                    )
            else:
                self.skips_in_row = 0
                self.engine.backward(loss)
                if self.lr_schedule != "deepspeed":
                    self.engine.set_lr(self._lr_at(step))
                self.engine.step()
            self.step = step
            # Model-parallel peers read the same batch: count it once.
            sentences, tokens = sentences / self.groups.mp_size, tokens / self.groups.mp_size
            self.samples_seen += int(sentences)
            window_tokens += int(tokens)
            if samples_log is not None:
                samples_log.write({"step": step, "ids": batch.sentence_ids.tolist()})
            mean_loss = loss_sum / self.world
            if metrics_log is not None:
                metrics_log.write(
                    {
                        "step": step,
                        "loss": mean_loss,
                        "skipped": bool(bad),
                        "tokens": int(tokens),
                        "time": time.perf_counter() - loop_started,
                    }
                )
            if step % cfg.log_interval == 0 or step == cfg.steps:
                elapsed = time.perf_counter() - window_started
                metrics = {name: float(v) for name, v in out.components.items()}
                metrics.update(out.metrics)
                metrics.update(self._interface_health(step))
                metrics.update(
                    loss=mean_loss,
                    lr=self.engine.lr,
                    grad_norm=self.engine.grad_norm() or 0.0,
                    skipped_steps=self.skipped + self.engine.skipped_steps,
                    tokens_per_s=window_tokens / max(elapsed, 1e-9),
                    samples_seen=self.samples_seen,
                )
                tracker.log_metrics(metrics, step)
                progress.update(step, metrics)
                window_tokens, window_started = 0, time.perf_counter()
            self._after_step(step, tracker)
            stopping = stop.agreed()
            if stopping or step % cfg.save_interval == 0 or step == cfg.steps:
                blocked = self._flush_tracker(tracker) + self.save()
                if metrics_log is not None:
                    metrics_log.write({"step": step, "checkpoint_seconds": blocked})
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


class _JsonLines:
    """Appends one JSON object per line; opened per write so a kill loses at most one line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(obj) + "\n")


class _Progress:
    """One line on rank 0: step, tokens/s, losses, learning rate, ETA."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.enabled = enabled
        self.total = total
        self.start = start
        self.started = time.perf_counter()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step - self.start
        rate = done / max(time.perf_counter() - self.started, 1e-9)
        eta = (self.total - step) / max(rate, 1e-9)
        losses = " ".join(
            f"{k}={v:.3f}"
            for k, v in metrics.items()
            if k.startswith(("enc_", "dec_", "denoise"))
            and "accuracy" not in k
            and not k.startswith("dec_vq_")
        )
        codebook = "".join(
            f" | {part} codes {metrics[f'{prefix}codes_used']:,.0f}/"
            f"{metrics[f'{prefix}codes_used'] + metrics[f'{prefix}dead_codes']:,.0f} "
            f"ppl {metrics[f'{prefix}code_perplexity']:,.1f}"
            for prefix, part in (("vq_", "enc"), ("dec_vq_", "dec"))
            if f"{prefix}codes_used" in metrics
        )
        print(
            f"step {step}/{self.total} | {metrics['tokens_per_s']:,.0f} tok/s | "
            f"loss {metrics['loss']:.3f} {losses}{codebook} | lr {metrics['lr']:.2e} | "
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
