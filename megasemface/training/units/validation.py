"""Validation during fine-tuning: BLEU and chrF of every direction, and the best model.

Every ``valid_interval`` steps each direction's validation text is translated, its
sentences spread over the data-parallel ranks and the translations gathered, then scored
with sacreBLEU. The model with the best mean BLEU over the directions is written to
``<output>/best/`` as a self-contained model directory, ready for ``tools/translate.py``;
with ``--register-model`` it is registered in MLflow's model registry after the last step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megasemface.data.text.lines import read_lines
from megasemface.distributed.collectives import all_gather_objects, rank, sum_or_max
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.distributed.groups import ParallelGroups
from megasemface.evaluation.metrics import evaluate
from megasemface.models.model_dir import save_model_dir
from megasemface.nn.config import ModelConfig
from megasemface.objectives.sequences import SequenceBatch
from megasemface.tracking.mlflow_names import describe_error
from megasemface.tracking.model_registry import register_best_model
from megasemface.tracking.tracker import Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData

__all__ = ["Validation", "register_best"]

logger = logging.getLogger(__name__)

REGISTER_FLUSH_S = 30.0
"""At most this long registering waits for the run's pending records to reach the store."""

Direction = tuple[str, str]
Generate = Callable[[SequenceBatch, str], list[list[int]]]
"""Translates a batch into a language: token ids per sentence, in lockstep with every rank."""
BatchOf = Callable[[list[list[int]], str], SequenceBatch]


class Validation:
    """The validation sets of a fine-tuning run and the best score so far."""

    def __init__(
        self,
        config: TrainConfig,
        data: RunData,
        directions: list[Direction],
        max_sentence_len: int,
    ) -> None:
        self.config = config
        self.data = data
        self.max_sentence_len = max_sentence_len
        """Source sentences are cut to this many tokens (the model's length less one)."""
        self.sets = self._read_sets(directions)
        self.best_bleu = -1.0
        self.best_step = 0

    def _read_sets(self, directions: list[Direction]) -> dict[Direction, tuple[Any, list[str]]]:
        """``{direction: (source token ids, reference texts)}``; empty without a prefix."""
        prefix = self.config.valid_prefix
        if prefix is None:
            return {}
        sets = {}
        limit = self.config.valid_max_sentences
        for src, tgt in directions:
            paths = [Path(f"{prefix}.{src}"), Path(f"{prefix}.{tgt}")]
            texts = []
            for path in paths:
                if not path.is_file():
                    raise FileNotFoundError(f"validation file not found: {path}")
                texts.append(read_lines(path)[:limit])
            if len(texts[0]) != len(texts[1]):
                raise ValueError(
                    f"{paths[0]} and {paths[1]} have different line counts "
                    f"({len(texts[0])}, {len(texts[1])} within the first {limit})"
                )
            sets[(src, tgt)] = (self.data.tokenizer.encode(texts[0]), texts[1])
        return sets

    def scores(
        self, generate: Generate, batch_of: BatchOf, groups: ParallelGroups
    ) -> dict[str, float]:
        """BLEU and chrF per direction (a collective: every rank translates its share)."""
        rank_, world = groups.dp_rank, groups.dp_size
        scores: dict[str, float] = {}
        for (src, tgt), (ids, refs) in self.sets.items():
            mine = list(range(rank_, len(ids), world))
            batches = self._batches([ids[i][: self.max_sentence_len] for i in mine])
            count = int(sum_or_max([float(len(batches))], "max")[0])
            hyps: list[list[int]] = []
            for k in range(count):  # ranks with fewer batches run empty ones, in lockstep
                if k < len(batches):
                    hyps += generate(batch_of(batches[k], src), tgt)
                else:
                    generate(batch_of([], src), tgt)
            texts = {i: self.data.tokenizer.decode(h) for i, h in zip(mine, hyps, strict=True)}
            merged = {i: t for part in all_gather_objects(texts) for i, t in part.items()}
            result = evaluate([merged[i] for i in range(len(ids))], refs)
            scores[f"valid_bleu_{src}-{tgt}"] = result.bleu.score
            scores[f"valid_chrf_{src}-{tgt}"] = result.chrf.score
        return scores

    def _batches(self, sentences: list[list[int]]) -> list[list[list[int]]]:
        """Token-budget batches of the sentences, in order."""
        budget = self.config.max_tokens
        batches: list[list[list[int]]] = [[]]
        longest = 0
        for sentence in sentences:
            longest_if = max(longest, len(sentence) + 1)
            if batches[-1] and longest_if * (len(batches[-1]) + 1) > budget:
                batches.append([])
                longest_if = len(sentence) + 1
            batches[-1].append(sentence)
            longest = longest_if
        return [b for b in batches if b]

    def record(
        self,
        engine: DeepSpeedEngine,
        model_config: ModelConfig,
        step: int,
        scores: dict[str, float],
        tracker: Tracker,
        parent_runs: dict[str, str],
    ) -> None:
        """Adds the means, keeps the model when it is the best so far, logs and prints."""
        count = len(self.sets)
        bleu = sum(v for k, v in scores.items() if k.startswith("valid_bleu_")) / count
        scores["valid_bleu"] = bleu
        scores["valid_chrf"] = sum(v for k, v in scores.items() if k.startswith("valid_chrf_"))
        scores["valid_chrf"] /= count
        improved = bleu > self.best_bleu
        if improved:
            self.best_bleu, self.best_step = bleu, step
            run_id = tracker.wait_for_run()  # the best model names its run
            self._save_best(engine, model_config, step, scores, run_id, parent_runs)
        scores["best_valid_bleu"] = self.best_bleu
        tracker.log_metrics(scores, step)
        if rank() == 0:
            shown = " ".join(f"{k}={v:.2f}" for k, v in sorted(scores.items()))
            print(f"step {step} | validation {shown}{' (best)' if improved else ''}", flush=True)

    def _save_best(
        self,
        engine: DeepSpeedEngine,
        model_config: ModelConfig,
        step: int,
        scores: dict[str, float],
        run_id: str | None,
        parent_runs: dict[str, str],
    ) -> None:
        inner = engine.module.model
        with engine.gathered(inner.parameters()):  # a collective under ZeRO-3
            state = (
                {k: v.detach().clone() for k, v in inner.state_dict().items()}
                if rank() == 0
                else None
            )
        if state is None:
            return
        cfg = self.config
        save_model_dir(
            cfg.output_dir / "best",
            state,
            kind="seq2seq",
            model_config=model_config,
            languages=self.data.languages,
            spm_model=cfg.spm_model,
            provenance={
                "fine-tuned": str(cfg.output_dir),
                "step": step,
                "init_from": str(cfg.init_from) if cfg.init_from else None,
            },
            meta={
                "stage": "finetune",
                "step": step,
                **scores,
                "parent_runs": {**parent_runs, "finetune": run_id},
            },
            overwrite=True,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best_bleu": self.best_bleu, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_bleu = float(state.get("best_bleu", -1.0))
        self.best_step = int(state.get("best_step", 0))


def register_best(config: TrainConfig, tracker: Tracker) -> None:
    """Registers ``<output>/best`` as ``--register-model`` asks, on the rank that tracks.

    A failure is reported, not raised: the run and its best model are complete without it,
    and running the command again registers it (without a duplicate version).
    """
    best = config.output_dir / "best"
    name = config.register_model
    if name is None or tracker.run_id is None or tracker.tracking_uri is None:
        return
    if not (best / "config.json").is_file():
        print(f"no best model in {best} to register as {name!r}", flush=True)
        return
    tracker.flush(timeout=REGISTER_FLUSH_S)
    try:
        version = register_best_model(tracker.tracking_uri, best, name=name)
    except Exception as exc:
        # The traceback only at debug level: the line below says what failed.
        logger.debug("registering %s as %r failed", best, name, exc_info=True)
        print(f"could not register {best} as {name!r}: {describe_error(exc)}", flush=True)
        return
    done = "registered" if version.created else "already registered"
    print(f"{done} {best} as {version.uri} (source {version.source})", flush=True)
