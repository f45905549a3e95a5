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

from pathlib import Path

import torch

from megasemface.distributed.collectives import rank
from megasemface.distributed.engine import DeepSpeedEngine
from megasemface.evaluation.validation_losses import (
    LangBatch,
    read_batches,
    score_part,
    scored_parts,
)
from megasemface.stages import stage
from megasemface.tracking.tracker import Tracker
from megasemface.training.options import TrainConfig
from megasemface.training.run_data import RunData

__all__ = ["PretrainingValidation"]


class PretrainingValidation:
    """The validation sentences of a pre-training run and how to score them
    (``evaluation/validation_losses.py`` defines the figures)."""

    def __init__(self, config: TrainConfig, data: RunData, max_len: int) -> None:
        self.config = config
        self.data = data
        self.batches = self._read(max_len) if config.valid_prefix is not None else []
        self.parts = scored_parts(stage(config.stage))

    def _read(self, max_len: int) -> list[LangBatch]:
        """The batches of every language of the shards, cut to the model's ``max_len``
        tokens."""
        held = self.data.data_languages()
        languages = [lang for lang in self.data.languages if lang in held]
        texts = {lang: Path(f"{self.config.valid_prefix}.{lang}") for lang in languages}
        for path in texts.values():
            if not path.is_file():
                raise FileNotFoundError(
                    f"--valid-prefix: {path} not found; pre-training validates every language "
                    f"of the shards ({', '.join(languages)}), one PREFIX.<lang> file of "
                    "sentences each"
                )
        tokenizer = self.data.tokenizer
        batches = read_batches(texts, tokenizer, self.config.valid_max_sentences, max_len)
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
                    losses = score_part(engine.forward, engine.module, self.batches, part)
                    figures.update(losses.figures())
        finally:
            engine.train()
        tracker.log_metrics(figures, step)
        if rank() == 0:
            shown = " ".join(f"{name}={value:.3f}" for name, value in figures.items())
            print(f"validation at step {step}: {shown}", flush=True)
        return figures
