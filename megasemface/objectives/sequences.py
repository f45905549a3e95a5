"""Special tokens and the sequence layouts the models read.

Loader batches hold bare sentences (no special tokens). Encoders read ``x </s>`` with the
language given by its embedding; decoders generating a language read ``<lang> x`` and predict
``x </s>`` (the target language tag starts decoding, as in mBART), the same layout in the
decoder stage, in denoising and in fine-tuning.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["SequenceBatch", "SpecialTokens", "append_token", "lengths_to_mask", "prepend_tokens"]


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    pad: int
    bos: int
    eos: int
    mask: int
    lang_tags: tuple[int, ...]
    """The tag id of language i (i: its index in the tokenizer's languages)."""

    @classmethod
    def from_tokenizer(cls, tokenizer: object) -> SpecialTokens:
        tok = tokenizer
        tags = tuple(tok.lang_id(lang) for lang in tok.languages)  # type: ignore[attr-defined]
        return cls(tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tags)  # type: ignore[attr-defined]

    @property
    def all(self) -> tuple[int, ...]:
        return (self.pad, self.bos, self.eos, self.mask, *self.lang_tags)


@dataclasses.dataclass
class SequenceBatch:
    """Sentences of a batch as the models take them: padded ids, lengths, language indices."""

    tokens_BT: torch.Tensor
    lengths_B: torch.Tensor
    langs_B: torch.Tensor

    @property
    def mask_BT(self) -> torch.Tensor:
        return lengths_to_mask(self.lengths_B, self.tokens_BT.shape[1])

    @classmethod
    def from_rows(cls, rows: list[list[int]], pad: int, lang_index: int) -> SequenceBatch:
        """Token-id sentences of one language, padded to the longest, on the host; no rows
        give a batch of none (a rank with nothing left still steps in lockstep)."""
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
        width = int(lengths.max()) if rows else 1
        tokens = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return cls(tokens, lengths, torch.full((len(rows),), lang_index, dtype=torch.long))


def lengths_to_mask(lengths_B: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length, device=lengths_B.device)[None, :] < lengths_B[:, None]


def append_token(
    tokens_BT: torch.Tensor, lengths_B: torch.Tensor, token: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> ``x token`` for every row (one column longer)."""
    batch, length = tokens_BT.shape
    out = torch.full((batch, length + 1), pad, dtype=tokens_BT.dtype, device=tokens_BT.device)
    out[:, :length] = tokens_BT
    out.scatter_(1, lengths_B[:, None], token)  # no host value copied to the device
    return out, lengths_B + 1


def prepend_tokens(
    tokens_BT: torch.Tensor, lengths_B: torch.Tensor, first_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> ``first x`` with a per-row first token (pads stay pads, one column longer)."""
    batch, length = tokens_BT.shape
    out = tokens_BT.new_empty(batch, length + 1)
    out[:, 1:] = tokens_BT
    out[:, 0] = first_B
    return out, lengths_B + 1
