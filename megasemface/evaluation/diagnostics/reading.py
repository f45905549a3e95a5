"""Does the connected, pre-trained model read a translation? The direct test of SemFace's
premise, before any fine-tuning.

SemFace pre-trains the decoder to read a language-independent interface, so a decoder that
reconstructs its own language should also read the encoder's output for a sentence in
another language. For line-aligned translations ``a`` and ``b``, and each direction a -> b,
this measures the decoder's teacher-forced NLL of each ``b`` sentence (nats per predicted
token, ``<lang> y`` -> ``y </s>``, as in the decoder stage) with three cross-attention
memories:

- ``translation``: the connected encoder's output for the ``a`` sentence it translates;
- ``unrelated``: the encoder's output for another ``a`` sentence of the nearest length
  (:func:`unrelated_partners`), so that the memory's length and language are the same and
  only its meaning differs;
- ``zeros``: nothing to read;
- ``recentred``: the translation's encoding with its language's mean output swapped for the
  target language's (each mean over the encoder's outputs for the measured sentences of that
  language, ``x </s>``, every position alike): an encoder whose outputs differ between
  languages by a shift alone reads as language-independent here, so the gap between
  ``translation`` and ``recentred`` is what that shift costs.

A language-independent interface gives ``translation`` clearly below ``unrelated`` and
``zeros``; a decoder that reads only its own language finds the translation no more useful
than nothing. With a
connected ``seq2seq`` model the zero-shot greedy translation a -> b is scored too (BLEU and
chrF against ``b``). Any connected model can be measured, so mBART's and XLM's, which have no
interface, are the references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megasemface.evaluation.diagnostics.figures import teacher_forced_nll
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig
from megasemface.inference.translate import Translator, token_batches
from megasemface.nn.transformer import EncoderOutput, TransformerDecoder
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
)

__all__ = [
    "READING_MEMORIES",
    "ReadingFigures",
    "mean_output",
    "read_translations",
    "unrelated_partners",
    "zero_shot_scores",
]

READING_MEMORIES = ("translation", "unrelated", "zeros", "recentred")
"""The memories of the NLL figures, in the order they are reported."""

Encode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], EncoderOutput]
"""``(tokens, mask, langs) -> EncoderOutput``: the connected model's encoder."""


@dataclasses.dataclass
class ReadingFigures:
    """The figures of one direction, source -> target."""

    source_lang: str
    target_lang: str
    pairs: int
    """Translation pairs measured (both sides non-blank)."""
    tokens: int
    """Target tokens predicted: each sentence's tokens and one </s>."""
    nll: dict[str, float]
    """Nats per predicted target token with each memory of :data:`READING_MEMORIES`."""
    bleu: float | None = None
    """Zero-shot greedy BLEU of the connected model, source -> target; None without one."""
    chrf: float | None = None

    @property
    def direction(self) -> str:
        return f"{self.source_lang}-{self.target_lang}"

    @property
    def gain_over_zeros(self) -> float:
        """How much better the decoder predicts the target reading its translation than
        reading nothing (nats per token; > 0 reads something of the other language)."""
        return self.nll["zeros"] - self.nll["translation"]

    @property
    def gain_over_unrelated(self) -> float:
        """How much better than reading an unrelated sentence of the same language."""
        return self.nll["unrelated"] - self.nll["translation"]

    @property
    def recentred_gain_over_zeros(self) -> float:
        """The gain over zeros with the two languages' mean outputs swapped (``recentred``)."""
        return self.nll["zeros"] - self.nll["recentred"]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            direction=self.direction,
            gain_over_zeros=self.gain_over_zeros,
            gain_over_unrelated=self.gain_over_unrelated,
            recentred_gain_over_zeros=self.recentred_gain_over_zeros,
        )
        return out

    def metrics(self) -> dict[str, float]:
        """``read_<src>_<tgt>_<figure>``: the NLLs, the two gains and the zero-shot scores."""
        prefix = f"read_{self.source_lang}_{self.target_lang}"
        out = {f"{prefix}_nll_{memory}": value for memory, value in self.nll.items()}
        out[f"{prefix}_gain_over_zeros"] = self.gain_over_zeros
        out[f"{prefix}_gain_over_unrelated"] = self.gain_over_unrelated
        out[f"{prefix}_recentred_gain_over_zeros"] = self.recentred_gain_over_zeros
        if self.bleu is not None and self.chrf is not None:
            out[f"{prefix}_zero_shot_bleu"] = self.bleu
            out[f"{prefix}_zero_shot_chrf"] = self.chrf
        return out


def unrelated_partners(lengths: Sequence[int]) -> list[int]:
    """For each sentence, another one of the nearest length: of its two neighbours in the
    order of (length, index), the one nearer in length (the next one on a tie). Never
    itself, so with line-aligned translations the partner is never its own translation."""
    if len(lengths) < 2:
        raise ValueError("an unrelated sentence needs at least 2 translation pairs")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    partners = [0] * len(lengths)
    for rank, i in enumerate(order):
        neighbours = [order[r] for r in (rank + 1, rank - 1) if 0 <= r < len(order)]
        partners[i] = min(neighbours, key=lambda j: abs(lengths[j] - lengths[i]))
    return partners


def _encoded(
    encode: Encode, rows: list[list[int]], special: SpecialTokens, lang_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's output for ``rows`` read as ``x </s>``, as in translation, and its mask."""
    batch = SequenceBatch.from_rows(rows, special.pad, lang_index)
    src_BT, lengths_B = append_token(batch.tokens_BT, batch.lengths_B, special.eos, special.pad)
    mask_BT = lengths_to_mask(lengths_B, src_BT.shape[1])
    return encode(src_BT, mask_BT, batch.langs_B).hidden_BTD, mask_BT


def mean_output(
    encode: Encode,
    sentences: Sequence[list[int]],
    special: SpecialTokens,
    lang_index: int,
    batch_tokens: int,
) -> torch.Tensor:
    """[D]: the encoder's mean output over every position of ``sentences`` (``x </s>``)."""
    total, positions = None, 0
    for rows in token_batches([len(s) + 1 for s in sentences], batch_tokens):
        hidden_BTD, mask_BT = _encoded(encode, [sentences[i] for i in rows], special, lang_index)
        summed = hidden_BTD[mask_BT].sum(dim=0)
        total = summed if total is None else total + summed
        positions += int(mask_BT.sum())
    assert total is not None  # read_translations needs at least 2 pairs
    return total / positions


def read_translations(
    decoder: TransformerDecoder,
    encode: Encode,
    special: SpecialTokens,
    sources: Sequence[list[int]],
    targets: Sequence[list[int]],
    langs: tuple[int, int],
    d_model: int,
    batch_tokens: int,
) -> tuple[dict[str, float], int]:
    """(NLL per predicted target token with each of :data:`READING_MEMORIES`, tokens).

    ``sources[i]`` and ``targets[i]`` are token ids of a translation pair (no special
    tokens), ``langs`` their language indices. Batches of target rows, longest first, in a
    fixed order: the same input gives the same figures.
    """
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources against {len(targets)} targets")
    partners = unrelated_partners([len(s) for s in sources])
    # What turns the source language's mean output into the target language's.
    shift_D = mean_output(encode, targets, special, langs[1], batch_tokens) - mean_output(
        encode, sources, special, langs[0], batch_tokens
    )
    sums = dict.fromkeys(READING_MEMORIES, 0.0)
    tokens = 0
    for rows in token_batches([len(t) + 1 for t in targets], batch_tokens):
        batch = SequenceBatch.from_rows([targets[i] for i in rows], special.pad, langs[1])
        translation_BSD, mask_BS = _encoded(encode, [sources[i] for i in rows], special, langs[0])
        memories = {
            "translation": (translation_BSD, mask_BS),
            "unrelated": _encoded(encode, [sources[partners[i]] for i in rows], special, langs[0]),
            # Zero keys and values are the same at every position: the length is moot.
            "zeros": (torch.zeros(*batch.tokens_BT.shape, d_model), batch.mask_BT),
            "recentred": (translation_BSD + shift_D, mask_BS),
        }
        for name, (memory_BSD, mask_BS) in memories.items():
            nll, count = teacher_forced_nll(decoder, special, batch, memory_BSD, mask_BS)
            sums[name] += nll
        tokens += count
    return {name: total / tokens for name, total in sums.items()}, tokens


def zero_shot_scores(
    translator: Translator,
    sources: Sequence[list[int]],
    references: Sequence[str],
    langs: tuple[str, str],
    batch_tokens: int,
) -> tuple[float, float]:
    """(BLEU, chrF) of the connected model's greedy translations of ``sources``."""
    hypotheses = translator.translate_ids(
        sources,
        src_lang=langs[0],
        tgt_lang=langs[1],
        config=SearchConfig(beam=1),
        batch_tokens=batch_tokens,
    )
    decoded = [translator.tokenizer.decode(h.tokens) for h in hypotheses]
    result = evaluate(decoded, list(references))
    return result.bleu.score, result.chrf.score
