"""What the interface diagnostics measure, as functions of tensors and modules.

Each function computes one figure of the paper's Fig. 5 analysis and of the project's own
checks (``docs/diagnostics.md``) from what a model gives back; loading models and walking
over text is :mod:`.diagnose`'s job. All of them run without gradients and return plain
numbers or small tensors.

Shapes: N tokens, M occurrences of one word, K codes, k the top-k size, D model width,
B batch, S memory length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megasemface.nn.transformer import TransformerDecoder
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.objectives.teacher_forcing import teacher_forced_logits

__all__ = [
    "CodeAgreement",
    "CodeUsageFigures",
    "WordCodes",
    "code_agreement",
    "cosine_sum",
    "teacher_forced_nll",
    "word_codes",
]


@dataclasses.dataclass(frozen=True)
class CodeUsageFigures:
    """How many codes the argmax of a VQ layer picks over a text."""

    tokens: int
    """Tokens quantised."""
    num_codes: int
    """K: the codes the layer can express."""
    used: int
    """Distinct codes chosen at least once."""
    perplexity: float
    """exp(H) of the histogram of chosen codes: the number of equally used codes with the same
    entropy (1 when one code takes every token, ``used`` when all used codes are equal)."""

    @property
    def fraction(self) -> float:
        """Share of the K codes used."""
        return self.used / self.num_codes

    @property
    def dead(self) -> int:
        """Codes never chosen."""
        return self.num_codes - self.used

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "num_codes": self.num_codes,
            "used": self.used,
            "fraction": self.fraction,
            "perplexity": self.perplexity,
            "dead": self.dead,
        }

    @classmethod
    def of(cls, figures: Mapping[str, float]) -> CodeUsageFigures:
        """From the figures an interface's ``code_figures`` gives."""
        return cls(
            int(figures["code_tokens"]),
            int(figures["codewords"]),
            int(figures["codes_used"]),
            figures["code_perplexity"],
        )


def cosine_sum(a_ND: Tensor, b_ND: Tensor) -> float:
    """Sum over rows of cos(a_i, b_i), in fp64 (the caller divides by its token count)."""
    return float(F.cosine_similarity(a_ND.double(), b_ND.double(), dim=-1).sum())


@dataclasses.dataclass(frozen=True)
class WordCodes:
    """A word's codes: the argmax and the top-k of its mean code distribution."""

    argmax: int
    top: tuple[int, ...]
    """The k most probable codes, most probable first."""
    occurrences: int


def word_codes(log_probs_MK: Tensor, k: int) -> WordCodes:
    """The codes of a word from its M occurrences' log-probabilities [M, K].

    The word's distribution is the mean of its occurrences' probabilities (computed as a
    log-sum-exp, so that tiny probabilities do not underflow before they are compared).
    """
    if log_probs_MK.shape[0] == 0:
        raise ValueError("a word needs at least one occurrence")
    mean = torch.logsumexp(log_probs_MK.double(), dim=0)  # log M off the mean: same ranking
    top = torch.topk(mean, min(k, mean.numel())).indices
    return WordCodes(int(mean.argmax()), tuple(int(c) for c in top), int(log_probs_MK.shape[0]))


@dataclasses.dataclass(frozen=True)
class CodeAgreement:
    """How translated word pairs share codes, against every pairing that is no translation."""

    pairs: int
    """Translation pairs measured."""
    same_code: float
    """Share of the pairs whose two words have the same argmax code."""
    overlap: float
    """Mean over the pairs of |top-k(a) ∩ top-k(b)| / k (the paper's Fig. 5 with k = 100)."""
    baseline_pairs: int
    """Pairings of a measured source word with a measured target word that are not
    translation pairs: the random baseline averages over all of them (no sampling)."""
    baseline_same_code: float | None
    baseline_overlap: float | None
    k: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def code_agreement(
    source: Mapping[Hashable, WordCodes],
    target: Mapping[Hashable, WordCodes],
    pairs: Sequence[tuple[Hashable, Hashable]],
    k: int,
) -> CodeAgreement:
    """Same-argmax share and top-k overlap of translation ``pairs`` and of all other pairings.

    ``pairs`` lists (source word, target word) keys of ``source`` and ``target``, without
    repeats. The baseline is exact: over every (s, t) in source x target that is not in
    ``pairs``, sum_c n_s(c) n_t(c) counts the pairings sharing code c (n: words with c as
    argmax, or with c in their top-k), minus what the translation pairs contribute.
    """
    pairs = list(dict.fromkeys(pairs))
    if not pairs:
        raise ValueError("no translation pair to measure")
    same = [source[s].argmax == target[t].argmax for s, t in pairs]
    shared = [len(set(source[s].top) & set(target[t].top)) for s, t in pairs]

    def coincidences(pick: str) -> int:
        """sum over codes of (source words with the code) x (target words with it)."""
        counts: list[dict[int, int]] = []
        for side in (source, target):
            seen: dict[int, int] = {}
            for codes in side.values():
                for c in (codes.argmax,) if pick == "argmax" else codes.top:
                    seen[c] = seen.get(c, 0) + 1
            counts.append(seen)
        return sum(n * counts[1].get(c, 0) for c, n in counts[0].items())

    others = len(source) * len(target) - len(pairs)
    base_same = base_overlap = None
    if others > 0:
        base_same = (coincidences("argmax") - sum(same)) / others
        base_overlap = (coincidences("top") - sum(shared)) / others / k
    return CodeAgreement(
        pairs=len(pairs),
        same_code=sum(same) / len(pairs),
        overlap=sum(shared) / len(pairs) / k,
        baseline_pairs=others,
        baseline_same_code=base_same,
        baseline_overlap=base_overlap,
        k=k,
    )


class _FixedMemory(nn.Module):
    """A stand-in for ``Seq2SeqModel`` whose cross-attention memory is given, not encoded:
    :func:`teacher_forced_logits` then lays out the decoder's input and targets exactly as
    the decoder stage and fine-tuning do, whatever the memory."""

    def __init__(self, decoder: TransformerDecoder, memory_BSD: Tensor, mask_BS: Tensor) -> None:
        super().__init__()
        self.decoder = decoder
        self.memory_BSD = memory_BSD
        self.mask_BS = mask_BS

    def forward(self, *args: Tensor) -> Tensor:
        tgt_in_BT, tgt_mask_BT, tgt_langs_B = args[3:]  # the source arguments are ignored
        return self.decoder(
            tgt_in_BT, tgt_mask_BT, tgt_langs_B, self.memory_BSD, self.mask_BS, causal=True
        )


def teacher_forced_nll(
    decoder: TransformerDecoder,
    special: SpecialTokens,
    batch: SequenceBatch,
    memory_BSD: Tensor,
    mask_BS: Tensor,
) -> tuple[float, int]:
    """(summed NLL in nats, predicted tokens) of the decoder reconstructing ``batch``.

    The causal LM of the decoder stage (Eq. 3) without noise: the decoder reads
    ``<lang> x`` and predicts ``x </s>``, cross-attending to ``memory_BSD``.
    """
    model: Any = _FixedMemory(decoder, memory_BSD, mask_BS)
    logits_NV, targets_N = teacher_forced_logits(model, special, batch, batch)
    nll = F.cross_entropy(logits_NV.float(), targets_N, reduction="sum")
    return float(nll), int(targets_N.numel())
