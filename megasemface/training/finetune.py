"""Fine-tuning the connected model on translation, through the pre-training loop.

Supervised: batches of sentence pairs from parallel shards (``build_shards --parallel``),
label-smoothed cross-entropy, each step one direction of the batch's pair. Unsupervised:
batches of monolingual sentences; the step's loss is the scheduled denoising loss plus
online back-translation: the current model translates the batch into the other language
(greedy, no gradient), and learns to translate that back into the original.

Generation (back-translation, validation) calls the model through the DeepSpeed engine and
in lockstep: every rank runs the same number of model calls, finished or not, so ZeRO-3's
parameter gathering (a collective inside every call) cannot hang.

Validation: every ``valid_interval`` steps, BLEU and chrF (sacreBLEU) of each direction on
the validation text; the model with the best mean BLEU is written to ``<output>/best/`` as a
self-contained model directory, ready for ``tools/translate.py``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megasemface.data.loader import TokenBatch
from megasemface.data.pairs import split_pairs
from megasemface.distributed.groups import ParallelGroups
from megasemface.evaluation.lines import read_lines
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig, search
from megasemface.models.config import ModelConfig, apply_overrides
from megasemface.models.connect import ConnectError
from megasemface.models.model_dir import load_model_dir, read_model_dir_info, save_model_dir
from megasemface.objectives.sequences import SequenceBatch, append_token, lengths_to_mask
from megasemface.objectives.stages import StageOutput
from megasemface.objectives.translation import TranslationModel
from megasemface.tracking.tracker import Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.trainer import Trainer

__all__ = ["FinetuneTrainer", "parse_schedule", "schedule_value"]

logger = logging.getLogger(__name__)


def parse_schedule(text: str) -> list[tuple[int, float]]:
    """``"0:1,100000:0.1,300000:0"`` -> [(0, 1.0), (100000, 0.1), (300000, 0.0)]."""
    points = []
    for item in text.split(","):
        step, sep, value = item.partition(":")
        try:
            points.append((int(step), float(value)))
        except ValueError:
            raise ValueError(f"schedule points are STEP:VALUE, got {item!r} in {text!r}") from None
        if not sep:
            raise ValueError(f"schedule points are STEP:VALUE, got {item!r} in {text!r}")
    if [s for s, _ in points] != sorted({s for s, _ in points}):
        raise ValueError(f"schedule steps must increase: {text!r}")
    return points


def schedule_value(points: list[tuple[int, float]], step: int) -> float:
    """Piecewise-linear interpolation; constant before the first and after the last point."""
    if step <= points[0][0]:
        return points[0][1]
    for (s0, v0), (s1, v1) in itertools.pairwise(points):
        if step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return points[-1][1]


class _EngineScorer:
    """The search protocol (encode, decode_step) through the DeepSpeed engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def encode(self, *args: Any) -> Any:
        return self.engine.forward("encode", *args)

    def decode_step(self, *args: Any) -> torch.Tensor:
        return self.engine.forward("decode_step", *args)


def _any_rank(flag: bool) -> bool:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class FinetuneTrainer(Trainer):
    def __init__(self, config: TrainConfig, ds_config: dict[str, Any], groups: ParallelGroups):
        self.best_bleu = -1.0
        self.best_step = 0
        self.init_info: Any = None
        if config.init_from is not None:
            self.init_info = read_model_dir_info(config.init_from, "seq2seq")
        super().__init__(config, ds_config, groups)
        self.directions = self._directions()
        self.denoise_points = parse_schedule(config.denoise_schedule)
        self.scorer = _EngineScorer(self.engine)
        self.valid_sets = self._read_valid_sets()

    # Data and model -------------------------------------------------------------------------

    def _check_data(self) -> None:
        cfg = self.config
        if cfg.finetune_mode == "supervised" and not self.pairs:
            raise ValueError(
                f"{cfg.data} holds monolingual shards; supervised fine-tuning reads parallel "
                "shards (tools/build_shards.py --parallel SRC-TGT:SRC_FILE,TGT_FILE)"
            )
        if cfg.finetune_mode == "unsupervised" and self.pairs:
            raise ValueError(
                f"{cfg.data} holds parallel shards; unsupervised fine-tuning reads monolingual "
                "shards"
            )
        data_langs = {lang for pair in self.pairs.values() for lang in pair}
        data_langs |= set(self.manifest.languages) - set(self.pairs)
        missing = sorted(data_langs - set(self.languages))
        if missing:
            raise ValueError(f"the tokenizer has no language tag for {missing}")

    def _model_config(self) -> ModelConfig:
        if self.init_info is None:
            return super()._model_config()
        info = self.init_info
        if info.vocab_sha256 != self.tokenizer.sha256 or info.languages != self.languages:
            raise ConnectError(
                f"{info.path} was trained with another SentencePiece model or languages "
                f"({info.languages}) than {self.config.spm_model} ({self.languages})"
            )
        # The shapes come from the model directory; options such as dropout may change.
        config = apply_overrides(info.model, self.config.model_options)
        for key in ("vocab_size", "d_model", "num_heads", "ffn_dim", "encoder_layers"):
            if getattr(config, key) != getattr(info.model, key):
                raise ValueError(f"--model {key}=... cannot change the shape of {info.path}")
        return config

    def _loader_max_len(self) -> int:
        if self.pairs:  # both sides and the separator; the sides are cropped per step
            return max(layout.max_length for layout in self.manifest.pair_layouts.values())
        return super()._loader_max_len()

    def _build_model(self, model_config: ModelConfig) -> tuple[torch.nn.Module, list[Any]]:
        cfg = self.config
        model = TranslationModel(model_config, self.special, label_smoothing=cfg.label_smoothing)
        if self.init_info is not None:
            state, info = load_model_dir(cfg.init_from, "seq2seq")  # type: ignore[arg-type]
            model.model.load_state_dict(state)
            sources = info.meta.get("parent_runs") or {}
            self.parent_runs.update({k: v for k, v in sources.items() if isinstance(v, str)})
        return model, list(model.parameters())

    def _directions(self) -> list[tuple[str, str]]:
        cfg = self.config
        if self.pairs:
            possible = {d for s, t in self.pairs.values() for d in ((s, t), (t, s))}
        else:
            langs = sorted(self.manifest.languages)
            if len(langs) != 2:
                raise ValueError(
                    f"unsupervised fine-tuning needs exactly two languages, {cfg.data} has {langs}"
                )
            possible = {(langs[0], langs[1]), (langs[1], langs[0])}
        if not cfg.directions:
            return sorted(possible)
        chosen = []
        for text in cfg.directions:
            src, _, tgt = text.partition("-")
            if (src, tgt) not in possible:
                raise ValueError(
                    f"--direction {text}: the data offers {['-'.join(d) for d in sorted(possible)]}"
                )
            chosen.append((src, tgt))
        return chosen

    def _read_valid_sets(self) -> dict[tuple[str, str], tuple[list[list[int]], list[str]]]:
        prefix = self.config.valid_prefix
        if prefix is None:
            return {}
        sets = {}
        limit = self.config.valid_max_sentences
        for src, tgt in self.directions:
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
            ids = self.tokenizer.encode(texts[0])
            sets[(src, tgt)] = (ids, texts[1])
        return sets

    # Steps ----------------------------------------------------------------------------------

    def _crop(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Sides longer than the model takes (less one special token) are cut."""
        limit = self.model_config.max_len - 1
        return tokens[:, :limit], lengths.clamp(max=limit)

    def _lang_index(self, lang: str, size: int) -> torch.Tensor:
        return torch.full((size,), self.languages.index(lang), dtype=torch.long)

    def _forward(self, batch: TokenBatch, generator: torch.Generator, step: int) -> StageOutput:
        if self.pairs:
            return self._supervised(batch, generator)
        return self._unsupervised(batch, generator, step)

    def _supervised(self, batch: TokenBatch, generator: torch.Generator) -> StageOutput:
        pair = self.pairs[batch.lang]
        separator = self.manifest.pair_layouts[batch.lang].separator_id
        sides = split_pairs(batch.tokens, batch.lengths, separator, self.special.pad)
        src = SequenceBatch(
            *self._crop(sides[0], sides[1]), self._lang_index(pair[0], len(sides[1]))
        )
        tgt = SequenceBatch(
            *self._crop(sides[2], sides[3]), self._lang_index(pair[1], len(sides[3]))
        )
        options = [d for d in self.directions if set(d) == set(pair)]
        if not options:
            raise ValueError(f"no --direction trains the pair {batch.lang} of the data")
        direction = options[int(torch.randint(len(options), (1,), generator=generator))]
        if direction != pair:
            src, tgt = tgt, src
        return self.engine.forward("supervised", src, tgt)

    def _unsupervised(
        self, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        tokens, lengths = self._crop(batch.tokens, batch.lengths)
        mono = SequenceBatch(tokens, lengths, self._lang_index(batch.lang, len(lengths)))
        # x (lang) -> y (other) by the current model, then learn y -> x, when y -> x is one
        # of the trained directions. Every rank generates every step (an empty batch when
        # its language needs none), which keeps the ranks in lockstep.
        sources = [src for src, tgt in self.directions if tgt == batch.lang]
        other = sources[0] if sources else None
        self.engine.eval()
        if other is None:
            self._generate(self._batch_of([], batch.lang), self.languages[0], beam=1)
            back = None
        else:
            back = self._batch_of(self._generate(mono, other, beam=1), other)
        self.engine.train()
        weight = schedule_value(self.denoise_points, step)
        return self.engine.forward("unsupervised", mono, generator, back, weight)

    def _batch_of(self, sentences: list[list[int]], lang: str) -> SequenceBatch:
        limit = self.model_config.max_len - 1
        rows = [s[:limit] or [self.tokenizer.unk_id] for s in sentences]  # never empty
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        width = int(lengths.max()) if rows else 1
        tokens = torch.full((len(rows), width), self.special.pad, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return SequenceBatch(tokens, lengths, self._lang_index(lang, len(rows)))

    def _generate(self, src: SequenceBatch, tgt_lang: str, beam: int) -> list[list[int]]:
        """Translations of ``src`` (token ids, no specials), in lockstep with every rank."""
        sp = self.special
        source, lengths = append_token(src.tokens_BT, src.lengths_B, sp.eos, sp.pad)
        config = SearchConfig(
            beam=beam, max_len_a=self.config.max_len_a, max_len_b=self.config.max_len_b
        )
        hypotheses = search(
            self.scorer,
            source,
            lengths_to_mask(lengths, source.shape[1]),
            src.langs_B,
            tgt_tags=self.tokenizer.lang_id(tgt_lang),
            tgt_langs=self.languages.index(tgt_lang),
            max_positions=self.model_config.max_len,
            config=config,
            eos_id=sp.eos,
            banned_ids=(sp.pad, sp.bos, sp.mask, *sp.lang_tags),
            keep_going=_any_rank,
        )
        return [h.tokens for h in hypotheses]

    # Validation -----------------------------------------------------------------------------

    def _after_step(self, step: int, tracker: Tracker) -> None:
        cfg = self.config
        if not self.valid_sets or (step % cfg.valid_interval and step != cfg.steps):
            return
        scores = self._validate()
        bleu = sum(v for k, v in scores.items() if k.startswith("valid_bleu_")) / len(
            self.valid_sets
        )
        scores["valid_bleu"] = bleu
        scores["valid_chrf"] = sum(
            v for k, v in scores.items() if k.startswith("valid_chrf_")
        ) / len(self.valid_sets)
        improved = bleu > self.best_bleu
        if improved:
            self.best_bleu, self.best_step = bleu, step
            self._save_best(step, scores)
        scores["best_valid_bleu"] = self.best_bleu
        tracker.log_metrics(scores, step)
        if self.is_main:
            shown = " ".join(f"{k}={v:.2f}" for k, v in sorted(scores.items()))
            print(f"step {step} | validation {shown}{' (best)' if improved else ''}", flush=True)

    def _validate(self) -> dict[str, float]:
        self.engine.eval()
        rank, world = self.groups.dp_rank, self.groups.dp_size
        scores: dict[str, float] = {}
        for (src, tgt), (ids, refs) in self.valid_sets.items():
            mine = list(range(rank, len(ids), world))
            batches = self._valid_batches([ids[i] for i in mine])
            count = int(_max_over_ranks(len(batches)))
            hyps: list[list[int]] = []
            for k in range(count):  # ranks with fewer batches run empty ones, in lockstep
                if k < len(batches):
                    hyps += self._generate(
                        self._batch_of(batches[k], src), tgt, self.config.valid_beam
                    )
                else:
                    self._generate(self._batch_of([], src), tgt, self.config.valid_beam)
            texts = {i: self.tokenizer.decode(h) for i, h in zip(mine, hyps, strict=True)}
            everything: list[dict[int, str]] = [{} for _ in range(world)]
            if dist.is_initialized() and world > 1:
                dist.all_gather_object(everything, texts)
            else:
                everything = [texts]
            merged = {i: t for part in everything for i, t in part.items()}
            result = evaluate([merged[i] for i in range(len(ids))], refs)
            scores[f"valid_bleu_{src}-{tgt}"] = result.bleu.score
            scores[f"valid_chrf_{src}-{tgt}"] = result.chrf.score
        self.engine.train()
        return scores

    def _valid_batches(self, sentences: list[list[int]]) -> list[list[list[int]]]:
        budget = self.config.max_tokens
        limit = self.model_config.max_len - 1
        batches: list[list[list[int]]] = [[]]
        longest = 0
        for sentence in sentences:
            sentence = sentence[:limit]
            longest_if = max(longest, len(sentence) + 1)
            if batches[-1] and longest_if * (len(batches[-1]) + 1) > budget:
                batches.append([])
                longest_if = len(sentence) + 1
            batches[-1].append(sentence)
            longest = longest_if
        return [b for b in batches if b]

    def _save_best(self, step: int, scores: dict[str, float]) -> None:
        inner = self.engine.module.model
        with self.engine.gathered(inner.parameters()):
            state = (
                {k: v.detach().clone() for k, v in inner.state_dict().items()}
                if self.is_main
                else None
            )
        if state is None:
            return
        save_model_dir(
            self.config.output_dir / "best",
            state,
            kind="seq2seq",
            model_config=self.model_config,
            languages=self.languages,
            spm_model=self.config.spm_model,
            provenance={
                "fine-tuned": str(self.config.output_dir),
                "step": step,
                "init_from": str(self.config.init_from) if self.config.init_from else None,
            },
            meta={
                "stage": "finetune",
                "step": step,
                **scores,
                "parent_runs": {**self.parent_runs, "finetune": self.run_id},
            },
            overwrite=True,
        )

    # Checkpoint extras ----------------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        return {"best_bleu": self.best_bleu, "best_step": self.best_step}

    def _restore_extra_state(self, state: dict[str, Any]) -> None:
        self.best_bleu = float(state.get("best_bleu", -1.0))
        self.best_step = int(state.get("best_step", 0))

    def _meta(self) -> dict[str, Any]:
        meta = super()._meta()
        meta["directions"] = ["-".join(d) for d in self.directions]
        return meta


def _max_over_ranks(value: int) -> float:
    tensor = torch.tensor([float(value)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
