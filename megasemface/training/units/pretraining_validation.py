"""Validation during pre-training: the stage's prediction losses on held-out text.

A SemFace stage's training loss is a poor learning curve. Each step draws a new mask and,
with the VQ interface, Gumbel-sampled codes: while the encoder's choices are still spread
over many codes (a per-token code entropy of 10 nats at the paper's 102,400), the MLM reads
mostly sampling noise and a single batch's figure swings by a nat. What a connected model
meets is the encoder in eval mode: no dropout, the noise-free code of every token. So every
``valid_interval`` steps (and at the last) the model is run that way on the same sentences of
every language (``PREFIX.<lang>``, the first ``valid_max_sentences`` of each) with the same
masks (a generator seeded per batch), and the mean loss per predicted token is logged:
``valid_enc_mlm`` (the encoder stage's MLM) and ``valid_dec_clm`` (the decoder stage's
prediction from the interface; ``valid_dec_mlm`` with the masked decoder objective). With
the VQ interface, the noise-free codewords the encoder picks for that text are counted too:
``valid_enc_codes_used`` and the perplexity of their histogram,
``valid_enc_code_perplexity``, whose ceiling is the smaller of the token count and the
codebook's codewords (a tenth of it or more: no collapse).

Every rank evaluates the whole set, so the figures are the same everywhere, any number of
ranks keeps ZeRO-3's forward passes in lockstep, and nothing is gathered; a few hundred
sentences a language cost a few forward passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from megasemface.data.text.lines import read_lines
from megasemface.distributed.collectives import rank
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.interfaces.vq.code_usage import count_codes, usage_figures
from megasemface.objectives.sequences import SequenceBatch
from megasemface.stages import STAGES, Stage, stage
from megasemface.tracking.tracker import Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData

__all__ = ["PretrainingValidation"]


BATCH_SENTENCES = 32
MASK_SEED = 12_345
"""Seeds the masks of every validation alike (plus the batch's index)."""


class PretrainingValidation:
    """The validation sentences of a pre-training run and how to score them."""

    def __init__(self, config: TrainConfig, data: RunData, max_len: int) -> None:
        self.config = config
        self.data = data
        self.batches = self._read(max_len) if config.valid_prefix is not None else []
        trained = stage(config.stage)
        # Each part the run trains is scored alone, as the stage that trains only that part
        # computes it (the joint stage: both).
        self.parts = [
            spec
            for spec in STAGES.values()
            if spec.semface
            and not spec.joint
            and ((spec.encoder and trained.encoder) or (spec.decoder and trained.decoder))
        ]

    def _read(self, max_len: int) -> list[SequenceBatch]:
        """Batches of at most ``BATCH_SENTENCES`` sentences of one language, cut to the
        model's ``max_len`` tokens (empty lines left out)."""
        batches = []
        held = self.data.data_languages()
        languages = [lang for lang in self.data.languages if lang in held]
        for lang in languages:
            path = Path(f"{self.config.valid_prefix}.{lang}")
            if not path.is_file():
                raise FileNotFoundError(
                    f"--valid-prefix: {path} not found; pre-training validates every language "
                    f"of the shards ({', '.join(languages)}), one PREFIX.<lang> file of "
                    "sentences each"
                )
            lines = read_lines(path)[: self.config.valid_max_sentences]
            rows = [ids[:max_len] for ids in self.data.tokenizer.encode(lines) if ids]
            for start in range(0, len(rows), BATCH_SENTENCES):
                chunk = rows[start : start + BATCH_SENTENCES]
                index = self.data.languages.index(lang)
                batches.append(SequenceBatch.from_rows(chunk, self.data.special.pad, index))
        if not batches:
            raise ValueError(f"--valid-prefix {self.config.valid_prefix}: no sentences to read")
        return batches

    def due(self, step: int) -> bool:
        return bool(self.batches) and (
            step % self.config.valid_interval == 0 or step == self.config.steps
        )

    def run(self, engine: DeepSpeedEngine, step: int, tracker: Tracker) -> dict[str, float]:
        """Scores the set with ``engine`` in eval mode, logs the figures at ``step`` and
        prints them on rank 0; training mode is restored."""
        engine.eval()
        try:
            with torch.no_grad():
                figures: dict[str, float] = {}
                for part in self.parts:
                    figures.update(self._score(engine, part))
        finally:
            engine.train()
        tracker.log_metrics(figures, step)
        if rank() == 0:
            shown = " ".join(f"{name}={value:.3f}" for name, value in figures.items())
            print(f"validation at step {step}: {shown}", flush=True)
        return figures

    def _score(self, engine: DeepSpeedEngine, part: Stage) -> dict[str, float]:
        model = engine.module
        # The decoder stage predicts the sentence left to right (clm) or its masked tokens.
        loss_name = "enc_mlm" if part.encoder else f"dec_{model.objective.decoder_objective}"
        total, targets, codes = 0.0, 0, []
        interface = model.interface
        with _stage(model, part.name):
            for index, batch in enumerate(self.batches):
                generator = torch.Generator().manual_seed(MASK_SEED + index)
                out = engine.forward(batch, generator)
                total += float(out.components[loss_name]) * out.num_targets
                targets += out.num_targets
                last = getattr(interface, "last_output", None)
                if part.encoder and last is not None:
                    codes.append(last.greedy_codes.cpu())
        figures = {f"valid_{loss_name}": total / max(targets, 1)}
        if codes:
            num_codes = interface.encoder_usage.num_codes
            usage = usage_figures(count_codes(torch.cat(codes), num_codes), num_codes)
            figures["valid_enc_codes_used"] = usage["codes_used"]
            figures["valid_enc_code_perplexity"] = usage["code_perplexity"]
            figures["valid_enc_code_tokens"] = usage["tokens"]
            figures["valid_enc_codewords"] = float(num_codes)
        return figures


@contextlib.contextmanager
def _stage(model: torch.nn.Module, name: str) -> Iterator[None]:
    """The model's forward computes stage ``name``'s loss alone (through the engine, so
    ZeRO-3 gathers what it needs), then the run's stage again."""
    trained = model.stage
    model.stage = name
    try:
        yield
    finally:
        model.stage = trained
