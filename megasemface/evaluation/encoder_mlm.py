"""The encoder MLM of a finished pre-training on validation text.

A training step's ``enc_mlm`` is one batch's, with a fresh mask (and, with the VQ interface,
Gumbel-sampled codes), so it swings by half a nat between logged steps. This is the figure
to compare pre-trainings by: the newest complete checkpoint of an encoder or joint stage
(XLM's encoder stage, the SemFace systems' joint stage), consolidated as
:func:`megasemface.checkpoints.load_stage` does, in eval mode, on the same sentences with
the same masks; the mean loss per predicted token per language and over all. It is
``valid_enc_mlm`` as training validation logs it (:mod:`.validation_losses`): given the
run's validation text and ``--valid-max-sentences``, the two agree.

``tools/valid_mlm.py`` is the command line over :func:`encoder_mlm`; the pipeline writes it
to ``<run>/valid-mlm.json`` for every pre-training with an encoder MLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megasemface.checkpoints import load_stage, resolve_spm_model
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.evaluation.diagnostics.sources import build_stage_model, stage_step
from megasemface.evaluation.validation_losses import read_batches, score_part, scored_parts
from megasemface.nn.cpu_speed import apply_cpu_speed
from megasemface.objectives.sequences import SpecialTokens
from megasemface.stages import find_stage, stage_names
from megasemface.tracking.run_scores import log_scores

__all__ = [
    "METRIC",
    "EncoderMlm",
    "EncoderMlmError",
    "LanguageMlm",
    "encoder_mlm",
    "log_to_run",
]

METRIC = "final_valid_enc_mlm"
"""The MLflow metric of the figure over all languages (``<METRIC>_<lang>``: of one); not
``valid_enc_mlm``, which training validation logs on its own sentences."""

_ENCODER_STAGES = stage_names(lambda spec: spec.encoder)
"""The stages that train an encoder MLM."""


class EncoderMlmError(ValueError):
    """The figure cannot be computed from this input; the message says what to pass."""


@dataclasses.dataclass
class LanguageMlm:
    """The encoder MLM on one language's text."""

    lang: str
    sentences: int
    targets: int
    """Predicted (masked) tokens."""
    mlm: float
    """Mean loss per predicted token, in nats."""


@dataclasses.dataclass
class EncoderMlm:
    """The encoder MLM of one checkpoint on validation text."""

    mlm: float
    """Mean loss per predicted token over every language's, in nats."""
    languages: list[LanguageMlm]
    step: int | None
    """The checkpoint's training step (None when unknown)."""
    stage: str
    interface: str | None
    max_sentences: int
    checkpoint: str
    mlflow_run_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def metrics(self) -> dict[str, float]:
        figures = {METRIC: self.mlm}
        figures |= {f"{METRIC}_{lang.lang}": lang.mlm for lang in self.languages}
        return figures

    def format_table(self) -> str:
        step = "unknown step" if self.step is None else f"step {self.step}"
        lines = [f"encoder MLM on validation text, {self.checkpoint} ({step}):"]
        for lang in self.languages:
            lines.append(
                f"  {lang.lang}: {lang.mlm:.4f} nats ({lang.sentences} sentences, "
                f"{lang.targets} predicted tokens)"
            )
        lines.append(f"  all: {self.mlm:.4f} nats")
        return "\n".join(lines)


def encoder_mlm(
    checkpoint: str | Path,
    texts: Mapping[str, Path],
    *,
    spm_model: str | Path | None = None,
    max_sentences: int,
) -> EncoderMlm:
    """The encoder MLM of ``checkpoint`` (a run directory: its newest complete checkpoint; a
    checkpoint directory; a ``pretraining`` model directory) on the first ``max_sentences``
    lines of each of ``texts`` (language -> one sentence a line), on the CPU.

    ``spm_model`` defaults to the one the stage recorded; any given one must be it.

    Raises:
        EncoderMlmError: a stage without an encoder MLM, or no sentence to score.
        DiagnosticsError: weights that do not fit the recorded model.
        CheckpointError, ModelDirError, FileNotFoundError, TextFileError, ValueError:
            unreadable input, or a language the SentencePiece model does not have.
    """
    if max_sentences < 1:
        raise EncoderMlmError(f"max_sentences must be >= 1, got {max_sentences}")
    checkpoint = Path(checkpoint)
    state, meta = load_stage(checkpoint)
    trained = find_stage(meta.get("stage"))
    if trained is None or not trained.encoder:
        raise EncoderMlmError(
            f"{checkpoint} holds a {meta.get('stage')!r} stage, which trains no encoder MLM; "
            f"pass an {' or '.join(_ENCODER_STAGES)} stage"
        )
    tokenizer = Tokenizer.load(resolve_spm_model(meta, spm_model))
    model = build_stage_model(state, meta, SpecialTokens.from_tokenizer(tokenizer), checkpoint)
    apply_cpu_speed(model, "cpu")
    # Room for </s> and the language tag: what the SemFace units' loader and validation
    # crop a sentence to (TrainUnit.loader_max_len).
    batches = read_batches(texts, tokenizer, max_sentences, model.config.max_len - 2)
    if not batches:
        raise EncoderMlmError(f"no sentences to score in {', '.join(map(str, texts.values()))}")
    part = next(spec for spec in scored_parts(trained) if spec.encoder)
    # The MLM reads only the objective's mlm_prob, which pre-training leaves at its default:
    # the model's own default objective computes the run's.
    with torch.no_grad():
        losses = score_part(model, model, batches, part)
    sentences: dict[str, int] = {}
    for item in batches:
        sentences[item.lang] = sentences.get(item.lang, 0) + int(item.batch.lengths_B.numel())
    languages = [
        LanguageMlm(lang, sentences[lang], losses.by_lang[lang][1], losses.lang_mean(lang))
        for lang in sentences
    ]
    return EncoderMlm(
        mlm=losses.mean,
        languages=languages,
        step=stage_step(meta),
        stage=trained.name,
        interface=(meta.get("interface") or {}).get("kind"),
        max_sentences=max_sentences,
        checkpoint=str(checkpoint.resolve()),
        mlflow_run_id=meta.get("mlflow_run_id") or None,
    )


def log_to_run(result: EncoderMlm, *, tracking_uri: str, run_id: str) -> int:
    """Logs :meth:`EncoderMlm.metrics` to an existing MLflow run at the checkpoint's step (0
    when unknown), and the whole result as its artifact ``valid-mlm.json``; returns the
    number of metrics logged."""
    metrics = result.metrics()
    text = json.dumps(result.to_dict(), indent=1)
    log_scores(
        tracking_uri, run_id, metrics, {}, step=result.step or 0, texts={"valid-mlm.json": text}
    )
    return len(metrics)
