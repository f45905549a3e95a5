"""A SemFace model's prediction losses on held-out text, in eval mode with fixed masks.

The one definition of the pre-training validation figures: the sentences of each language
(the first ``max_sentences`` lines, empty ones left out, cut to the model's length), in
batches of :data:`BATCH_SENTENCES` of one language, the languages in the tokenizer's order;
batch ``i`` draws its masks from a generator seeded ``MASK_SEED + i``; each figure is the
mean loss per predicted token over the whole set. Each part a stage trains is scored alone,
as the stage that trains only that part computes it (the joint stage: both).

Training validates through the DeepSpeed engine while it trains
(``training/units/pretraining_validation.py``); the encoder MLM of a finished run is
computed on the consolidated checkpoint with the plain model (:mod:`.encoder_mlm`). Both
call :func:`score_part`, so the two give the same figure for the same weights and text.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from megasemface.data.text.lines import read_lines
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.objectives.objective import StageOutput
from megasemface.objectives.sequences import SequenceBatch
from megasemface.stages import STAGES, Stage

__all__ = [
    "BATCH_SENTENCES",
    "MASK_SEED",
    "LangBatch",
    "PartLosses",
    "read_batches",
    "score_part",
    "scored_parts",
]

BATCH_SENTENCES = 32
MASK_SEED = 12_345
"""Seeds the masks of every validation alike (plus the batch's index)."""

Forward = Callable[[SequenceBatch, torch.Generator], StageOutput]
"""The model's forward on a batch: a plain model's call, or the engine's ``forward``."""


@dataclasses.dataclass(frozen=True)
class LangBatch:
    """A batch of validation sentences and their language."""

    lang: str
    batch: SequenceBatch


def read_batches(
    texts: Mapping[str, Path], tokenizer: Tokenizer, max_sentences: int, max_len: int
) -> list[LangBatch]:
    """The batches of ``texts`` (language -> file), the languages in the tokenizer's order
    (which fixes each batch's index, so its masks): at most ``BATCH_SENTENCES`` sentences of
    one language each, of the first ``max_sentences`` lines, cut to ``max_len`` tokens.

    Raises:
        ValueError: a language the tokenizer does not have.
        FileNotFoundError, TextFileError: an unreadable text.
    """
    unknown = sorted(set(texts) - set(tokenizer.languages))
    if unknown:
        raise ValueError(
            f"language(s) {', '.join(unknown)} not in the SentencePiece model "
            f"({', '.join(tokenizer.languages)})"
        )
    batches = []
    for index, lang in enumerate(tokenizer.languages):
        if lang not in texts:
            continue
        lines = read_lines(texts[lang])[:max_sentences]
        rows = [ids[:max_len] for ids in tokenizer.encode(lines) if ids]
        for start in range(0, len(rows), BATCH_SENTENCES):
            chunk = rows[start : start + BATCH_SENTENCES]
            batches.append(LangBatch(lang, SequenceBatch.from_rows(chunk, tokenizer.pad_id, index)))
    return batches


def scored_parts(trained: Stage) -> list[Stage]:
    """The stages that train one part of what ``trained`` trains (the joint stage: the
    encoder and the decoder stage), in registration order."""
    return [
        spec
        for spec in STAGES.values()
        if spec.semface
        and not spec.joint
        and ((spec.encoder and trained.encoder) or (spec.decoder and trained.decoder))
    ]


@dataclasses.dataclass
class PartLosses:
    """One part's summed loss over the set, per language and over all."""

    loss_name: str
    """``enc_mlm``, ``dec_clm`` or ``dec_mlm``: the component of the model's output."""
    total: float = 0.0
    targets: int = 0
    by_lang: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)
    """language -> (summed loss, predicted tokens)."""
    codes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The encoder's noise-free codes of every token (a VQ encoder)."""
    code_figures: Callable[[torch.Tensor], dict[str, float]] | None = None
    """The figures of those codes (the interface's ``code_figures``)."""

    @property
    def mean(self) -> float:
        """The mean loss per predicted token over the set."""
        return self.total / max(self.targets, 1)

    def lang_mean(self, lang: str) -> float:
        total, targets = self.by_lang[lang]
        return total / max(targets, 1)

    def figures(self) -> dict[str, float]:
        """``valid_<loss>`` and, with a VQ encoder's codes, their usage (``valid_enc_*``)."""
        figures = {f"valid_{self.loss_name}": self.mean}
        if self.codes and self.code_figures is not None:
            usage = self.code_figures(torch.cat(self.codes))
            figures.update({f"valid_enc_{name}": value for name, value in usage.items()})
        return figures


def score_part(
    forward: Forward, model: torch.nn.Module, batches: list[LangBatch], part: Stage
) -> PartLosses:
    """``part``'s loss over ``batches`` through ``forward``, the call of ``model`` (a
    ``SemFaceModel``) or of the engine that wraps it; the caller sets eval mode and turns
    gradients off."""
    # The decoder stage predicts the sentence left to right (clm) or its masked tokens.
    loss_name = "enc_mlm" if part.encoder else f"dec_{model.objective.decoder_objective}"
    losses = PartLosses(loss_name)
    interface = model.interface
    with _stage(model, part.name):
        for index, item in enumerate(batches):
            generator = torch.Generator().manual_seed(MASK_SEED + index)
            out = forward(item.batch, generator)
            summed = float(out.components[loss_name]) * out.num_targets
            losses.total += summed
            losses.targets += out.num_targets
            total, targets = losses.by_lang.get(item.lang, (0.0, 0))
            losses.by_lang[item.lang] = (total + summed, targets + out.num_targets)
            codes = interface.encoder_codes() if part.encoder else None
            if codes is not None:
                losses.codes.append(codes.cpu())
                losses.code_figures = interface.code_figures
    return losses


@contextlib.contextmanager
def _stage(model: torch.nn.Module, name: str) -> Iterator[None]:
    """The model's forward computes stage ``name``'s loss alone (through the engine, so
    ZeRO-3 gathers what it needs), then the model's stage again."""
    trained = model.stage
    model.stage = name
    try:
        yield
    finally:
        model.stage = trained
