"""Fine-tuning units: the connected model trained on translation.

Supervised: batches of sentence pairs from parallel shards (``build_shards --parallel``),
label-smoothed cross-entropy, each step one direction of the batch's pair. Unsupervised:
batches of monolingual sentences; the step's loss is the scheduled denoising loss plus
online back-translation: the current model translates the batch into the other language
(greedy, no gradient), and learns to translate that back into the original.

Generation (back-translation, validation) calls the model through the DeepSpeed engine and
in lockstep: every rank runs the same number of model calls, finished or not, so ZeRO-3's
parameter gathering (a collective inside every call) cannot hang.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megasemface.data.loading.loader import TokenBatch
from megasemface.data.loading.pairs import split_pairs
from megasemface.distributed.collectives import any_rank
from megasemface.distributed.engine import DeepSpeedEngine, on_device
from megasemface.distributed.groups import ParallelGroups
from megasemface.inference.search import SearchConfig, search
from megasemface.interfaces.registry import NONE, find_interface
from megasemface.models.model_dir import ModelDirInfo, load_seq2seq_state
from megasemface.models.seq2seq_init import ConnectError
from megasemface.models.translation import TranslationModel
from megasemface.nn.config import ModelConfig, apply_overrides
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch, append_token, lengths_to_mask
from megasemface.tracking.tracker import Tracker
from megasemface.training import model_flops
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData
from megasemface.training.schedules import parse_schedule, schedule_value
from megasemface.training.units.base import TrainUnit, model_config_from, ras_from, substitute
from megasemface.training.units.validation import Validation, register_best

__all__ = ["SupervisedUnit", "TranslationUnit", "UnsupervisedUnit"]


class _EngineScorer:
    """The search protocol (encode, decode_step) through the DeepSpeed engine, on the
    engine's device (the search makes its tensors there)."""

    def __init__(self, engine: DeepSpeedEngine, seq2seq: Seq2SeqModel) -> None:
        self.engine = engine
        self.seq2seq = seq2seq
        """The sequence-to-sequence model inside the one the engine wraps."""
        self.device = engine.device

    def encode(self, *args: Any) -> Any:
        return self.engine.run(self.seq2seq.encode, *args)

    def decode_step(self, *args: Any) -> torch.Tensor:
        return self.engine.run(self.seq2seq.decode_step, *args)


class TranslationUnit(TrainUnit):
    """``--stage finetune``: the translation model, from ``--init-from`` or random (the
    Transformer baseline), validated every ``valid_interval`` steps; the best model by
    validation BLEU is kept as a model directory."""

    lr_schedule = "inverse_sqrt"

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        self._check_data()
        init, state = None, None
        if config.init_from is not None:
            # Checked against its config before any model is built from that config.
            state, init = load_seq2seq_state(config.init_from)
        self.model_config = (
            model_config_from(config, data) if init is None else self._init_config(init)
        )
        model = self.build_model(self.model_config)
        if init is not None and state is not None:
            model.model.load_state_dict(state)
            sources = init.meta.get("parent_runs") or {}
            self.parent_runs.update({k: v for k, v in sources.items() if isinstance(v, str)})
        self.init = init
        self.model = model
        self.directions = self._directions()
        self.validation = Validation(config, data, self.directions, self.model_config.max_len - 1)

    def build_model(self, model_config: ModelConfig) -> TranslationModel:
        """The model the unit trains (a subclass's hook: deep fusion's has more losses)."""
        return TranslationModel(
            model_config, self.data.special, label_smoothing=self.config.label_smoothing
        )

    def run_tags(self) -> dict[str, str]:
        """The interface of the pre-training the model starts from (``none`` for XLM, mBART,
        mRASP, VECO and a random start), so filtering runs on ``interface`` finds fine-tuned
        SemFace models too, and ``pretraining``: how it was made (semface, xlm, mbart, mrasp,
        veco or none)."""
        if self.init is None:
            return {"interface": "none", "pretraining": "none"}
        kind = self.init.interface.get("kind")
        return {
            "interface": kind if (spec := find_interface(kind)) and spec.semface else NONE,
            "pretraining": str(self.init.meta.get("mode", "unknown")),
        }

    def _check_data(self) -> None:
        """Refuses shards of the wrong kind for the mode (a subclass hook)."""

    def _init_config(self, info: ModelDirInfo) -> ModelConfig:
        """The shape of the model directory; options such as dropout may change."""
        data = self.data
        if info.vocab_sha256 != data.tokenizer.sha256 or info.languages != data.languages:
            raise ConnectError(
                f"{info.path} was trained with another SentencePiece model or languages "
                f"({info.languages}) than {self.config.spm_model} ({data.languages})"
            )
        config = apply_overrides(info.model, self.config.model_options)
        for key in ("vocab_size", "d_model", "num_heads", "ffn_dim", "encoder_layers"):
            if getattr(config, key) != getattr(info.model, key):
                raise ValueError(f"--model {key}=... cannot change the shape of {info.path}")
        return config

    def _possible_directions(self) -> set[tuple[str, str]]:
        raise NotImplementedError

    def _directions(self) -> list[tuple[str, str]]:
        possible = self._possible_directions()
        if not self.config.directions:
            return sorted(possible)
        chosen = []
        for text in self.config.directions:
            src, _, tgt = text.partition("-")
            if (src, tgt) not in possible:
                raise ValueError(
                    f"--direction {text}: the data offers {['-'.join(d) for d in sorted(possible)]}"
                )
            chosen.append((src, tgt))
        return chosen

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def crop(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Sides longer than the model takes (less one special token) are cut."""
        limit = self.model_config.max_len - 1
        return tokens[:, :limit], lengths.clamp(max=limit)

    def batch_of(self, sentences: list[list[int]], lang: str) -> SequenceBatch:
        """Token-id sentences (no specials) as a padded batch in ``lang``."""
        limit = self.model_config.max_len - 1
        rows = [s[:limit] or [self.data.tokenizer.unk_id] for s in sentences]  # never empty
        return SequenceBatch.from_rows(rows, self.data.special.pad, self.data.languages.index(lang))

    def generate(
        self,
        engine: DeepSpeedEngine,
        src: SequenceBatch,
        tgt_lang: str,
        beam: int,
        min_len_a: float = 0.0,
    ) -> list[list[int]]:
        """Translations of ``src`` (token ids, no specials), in lockstep with every rank;
        none ends before ``min_len_a`` x its source's length."""
        sp, tokenizer, languages = self.data.special, self.data.tokenizer, self.data.languages
        # Batches are built on the host (the loader's, validation's, back-translation's):
        # moved to the model's device before the search makes anything from them.
        src = on_device(src, engine.device)
        source, lengths = append_token(src.tokens_BT, src.lengths_B, sp.eos, sp.pad)
        cfg = self.config
        config = SearchConfig(
            beam=beam,
            max_len_a=cfg.max_len_a,
            max_len_b=cfg.max_len_b,
            min_len_a=min_len_a,
            no_repeat_ngram=cfg.no_repeat_ngram_size,
        )
        hypotheses = search(
            _EngineScorer(engine, self.model.model),
            source,
            lengths_to_mask(lengths, source.shape[1]),
            src.langs_B,
            tgt_tags=tokenizer.lang_id(tgt_lang),
            tgt_langs=languages.index(tgt_lang),
            max_positions=self.model_config.max_len,
            config=config,
            eos_id=sp.eos,
            banned_ids=(sp.pad, sp.bos, sp.mask, *sp.lang_tags),
            keep_going=any_rank,
        )
        return [h.tokens for h in hypotheses]

    def after_step(self, engine: DeepSpeedEngine, step: int, tracker: Tracker) -> None:
        cfg = self.config
        if not self.validation.sets or (step % cfg.valid_interval and step != cfg.steps):
            return
        engine.eval()
        scores = self.validation.scores(
            lambda batch, lang: self.generate(engine, batch, lang, cfg.valid_beam),
            self.batch_of,
            self.groups,
        )
        engine.train()
        self.validation.record(engine, self.model_config, step, scores, tracker, self.parent_runs)

    def after_training(self, engine: DeepSpeedEngine, tracker: Tracker) -> None:
        register_best(self.config, tracker)

    def meta(self, engine: DeepSpeedEngine) -> dict[str, Any]:
        return {**super().meta(engine), "directions": ["-".join(d) for d in self.directions]}

    def state_dict(self) -> dict[str, Any]:
        return self.validation.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validation.load_state_dict(state)


class SupervisedUnit(TranslationUnit):
    """``--finetune-mode supervised``: translation cross-entropy on parallel shards; with
    ``--finetune-ras``, random aligned substitution on the source side."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        sources = {src for src, _ in self.directions}
        self.ras = ras_from(config, data, sources) if self.substitutes() else None

    def substitutes(self) -> bool:
        """Whether the source side gets random aligned substitution."""
        return self.config.finetune_ras

    def _check_data(self) -> None:
        if not self.data.pairs:
            raise ValueError(
                f"{self.config.data} holds monolingual shards; supervised fine-tuning reads "
                "parallel shards (tools/build_shards.py --parallel SRC-TGT:SRC_FILE,TGT_FILE)"
            )

    def loader_max_len(self) -> int:
        # Both sides and the separator; the sides are cropped per step.
        return max(layout.max_length for layout in self.data.manifest.pair_layouts.values())

    def _possible_directions(self) -> set[tuple[str, str]]:
        return {d for s, t in self.data.pairs.values() for d in ((s, t), (t, s))}

    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        pair = self.data.pairs[batch.lang]
        separator = self.data.manifest.pair_layouts[batch.lang].separator_id
        sides = split_pairs(batch.tokens, batch.lengths, separator, self.data.special.pad)
        src = SequenceBatch(
            *self.crop(sides[0], sides[1]), self.data.lang_index(pair[0], len(sides[1]))
        )
        tgt = SequenceBatch(
            *self.crop(sides[2], sides[3]), self.data.lang_index(pair[1], len(sides[3]))
        )
        options = [d for d in self.directions if set(d) == set(pair)]
        if not options:
            raise ValueError(f"no --direction trains the pair {batch.lang} of the data")
        direction = options[int(torch.randint(len(options), (1,), generator=generator))]
        if direction != pair:
            src, tgt = tgt, src
        figures: dict[str, float] = {}
        if self.ras is not None:
            # The source side alone, split from its target: nothing crosses the separator.
            limit = self.model_config.max_len - 1
            src, figures = substitute(self.ras, src, direction[0], generator, limit)
        (rows, source), target = src.tokens_BT.shape, tgt.tokens_BT.shape[1]
        self.body_flops = model_flops.seq2seq_body(self.model_config, rows, source, target)
        out = self.pair_loss(engine, src, tgt, generator)
        out.metrics.update(figures)
        return out

    def pair_loss(
        self,
        engine: DeepSpeedEngine,
        src: SequenceBatch,
        tgt: SequenceBatch,
        generator: torch.Generator,
    ) -> StageOutput:
        """The step's loss on the direction's pairs (a subclass's hook)."""
        return engine.run(self.model.translation_loss, src, tgt)


class UnsupervisedUnit(TranslationUnit):
    """``--finetune-mode unsupervised``: scheduled denoising plus online back-translation
    on monolingual shards of two languages."""

    def __init__(self, config: TrainConfig, data: RunData, groups: ParallelGroups) -> None:
        super().__init__(config, data, groups)
        self.denoise_points = parse_schedule(config.denoise_schedule)

    def _check_data(self) -> None:
        if self.data.pairs:
            raise ValueError(
                f"{self.config.data} holds parallel shards; unsupervised fine-tuning reads "
                "monolingual shards"
            )

    def _possible_directions(self) -> set[tuple[str, str]]:
        langs = sorted(self.data.manifest.languages)
        if len(langs) != 2:
            raise ValueError(
                "unsupervised fine-tuning needs exactly two languages, "
                f"{self.config.data} has {langs}"
            )
        return {(langs[0], langs[1]), (langs[1], langs[0])}

    def loss(
        self, engine: DeepSpeedEngine, batch: TokenBatch, generator: torch.Generator, step: int
    ) -> StageOutput:
        tokens, lengths = self.crop(batch.tokens, batch.lengths)
        mono = SequenceBatch(tokens, lengths, self.data.lang_index(batch.lang, len(lengths)))
        # x (lang) -> y (other) by the current model, then learn y -> x, when y -> x is one
        # of the trained directions. Every rank generates every step (an empty batch when
        # its language needs none), which keeps the ranks in lockstep.
        sources = [src for src, tgt in self.directions if tgt == batch.lang]
        other = sources[0] if sources else None
        engine.eval()
        if other is None:
            self.generate(engine, self.batch_of([], batch.lang), self.data.languages[0], beam=1)
            back = None
        else:
            generated = self.generate(
                engine, mono, other, beam=1, min_len_a=self.config.bt_min_len_a
            )
            back = self.batch_of(generated, other)
        engine.train()
        weight = schedule_value(self.denoise_points, step)
        rows, width = tokens.shape
        self.body_flops = 0.0  # the losses' passes; generating the back-translations is not
        if weight > 0:  # denoising, the noised copy at the sentence's width
            self.body_flops += model_flops.seq2seq_body(self.model_config, rows, width, width)
        if back is not None:
            source = back.tokens_BT.shape[1]
            self.body_flops += model_flops.seq2seq_body(self.model_config, rows, source, width)
        return engine.run(self.model.unsupervised_loss, mono, generator, back, weight)
