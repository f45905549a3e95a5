"""Translating text with a ``seq2seq`` model directory, in token-budget batches.

Sentences are encoded with the model's own SentencePiece model, sorted by length (so that a
batch holds sentences of similar length and little padding), cut into batches of at most
``batch_tokens`` source tokens (padding included), searched, decoded, and put back in input
order. Sources longer than the position embeddings allow are cropped (with one warning that
counts them); empty sentences translate to empty strings without running the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.inference.search import Hypothesis, SearchConfig, search
from megasemface.models.model_dir import ModelDirError, load_seq2seq
from megasemface.nn.cpu_speed import apply_cpu_speed
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.sequences import SpecialTokens

__all__ = ["Translator", "banned_ids", "token_batches"]

logger = logging.getLogger(__name__)


def token_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped longest first, each group within ``batch_tokens``.

    A group's cost is its size times its longest length (padding included). A sentence longer
    than the budget gets a group of its own rather than an error.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    # Longest first: the batch that needs the most memory runs first, so a budget that does
    # not fit fails at once rather than at the end.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def banned_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Ids that never belong in a translation: pad, bos, ``<mask>`` and the language tags,
    and pieces past the tokenizer's vocabulary (a padded output layer), which could not even
    be decoded. Exported models suppress the same ids."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    return sorted(
        {special.pad, special.bos, special.mask, *special.lang_tags}
        | set(range(tokenizer.vocab_size, vocab_size))
    )


class Translator:
    """Translates sentences between the languages of a model and its tokenizer."""

    def __init__(
        self, model: Seq2SeqModel, tokenizer: Tokenizer, device: str | torch.device = "cpu"
    ) -> None:
        """Takes a ``Seq2SeqModel`` and the tokenizer it was trained with; puts it in eval mode.

        Raises:
            ValueError: the tokenizer does not fit the model (vocabulary, languages).
        """
        config = model.config
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} pieces, the model only "
                f"{config.vocab_size}: not the tokenizer this model was trained with"
            )
        if len(tokenizer.languages) > config.num_langs:
            raise ValueError(
                f"the tokenizer has {len(tokenizer.languages)} languages "
                f"({', '.join(tokenizer.languages)}), the model {config.num_langs}"
            )
        self.device = torch.device(device)
        apply_cpu_speed(model, self.device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_positions = config.max_len
        self.banned_ids = banned_ids(tokenizer, config.vocab_size)

    @classmethod
    def from_model_dir(
        cls, path: str | os.PathLike[str], device: str | torch.device = "cpu"
    ) -> Translator:
        """Loads a ``seq2seq`` model directory (weights, config and SentencePiece model)."""
        model, info = load_seq2seq(path)
        tokenizer = Tokenizer.load(info.spm_model)
        if tokenizer.languages != info.languages:
            raise ModelDirError(
                f"{path}/config.json lists languages {info.languages}, its spm.model "
                f"{tokenizer.languages}"
            )
        assert isinstance(model, Seq2SeqModel)
        return cls(model, tokenizer, device)

    @property
    def languages(self) -> list[str]:
        return self.tokenizer.languages

    def translate(
        self,
        sentences: Sequence[str],
        *,
        src_lang: str,
        tgt_lang: str,
        config: SearchConfig | None = None,
        batch_tokens: int = 4096,
    ) -> list[str]:
        """Translations of ``sentences``, in order; an empty or blank sentence gives ``""``."""
        if isinstance(sentences, str):
            raise TypeError("translate takes a list of sentences; wrap a single one in a list")
        self.language_index(src_lang)  # checked even when every sentence is empty
        self.language_index(tgt_lang)
        ids = self.tokenizer.encode(list(sentences))
        nonempty = [i for i, seq in enumerate(ids) if seq]
        hypotheses = self.translate_ids(
            [ids[i] for i in nonempty],
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            config=config,
            batch_tokens=batch_tokens,
        )
        out = [""] * len(ids)
        for index, hypothesis in zip(nonempty, hypotheses, strict=True):
            out[index] = self.tokenizer.decode(hypothesis.tokens)
        return out

    def translate_ids(
        self,
        sources: Sequence[Sequence[int]],
        *,
        src_lang: str,
        tgt_lang: str,
        config: SearchConfig | None = None,
        batch_tokens: int = 4096,
    ) -> list[Hypothesis]:
        """Searches translations of token-id sources (no ``</s>``), in order."""
        config = config or SearchConfig()
        src_index, tgt_index = self.language_index(src_lang), self.language_index(tgt_lang)
        eos = self.tokenizer.eos_id
        room = self.max_positions - 1  # the encoder input is x </s>
        cropped = sum(len(s) > room for s in sources)
        if cropped:
            logger.warning(
                "%d of %d sources are longer than %d tokens and were cropped to fit the model",
                cropped,
                len(sources),
                room,
            )
        inputs = [[*list(s)[:room], eos] for s in sources]
        results: list[Hypothesis | None] = [None] * len(inputs)
        for batch in token_batches([len(s) for s in inputs], batch_tokens):
            src_BS, mask_BS = self._pad([inputs[i] for i in batch])
            hypotheses = search(
                self.model,
                src_BS,
                mask_BS,
                torch.full((len(batch),), src_index, dtype=torch.long, device=self.device),
                tgt_tags=self.tokenizer.lang_id(tgt_lang),
                tgt_langs=tgt_index,
                max_positions=self.max_positions,
                config=config,
                eos_id=eos,
                banned_ids=self.banned_ids,
            )
            for index, hypothesis in zip(batch, hypotheses, strict=True):
                results[index] = hypothesis
        assert all(h is not None for h in results)  # every index is in exactly one batch
        return [h for h in results if h is not None]

    def language_index(self, lang: str) -> int:
        """Index of ``lang`` among the model's languages (its language embedding).

        Raises:
            ValueError: the model does not know the language.
        """
        if lang not in self.languages:
            raise ValueError(
                f"language {lang!r} is not one of this model's languages: "
                f"{', '.join(self.languages)}"
            )
        return self.languages.index(lang)

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(r) for r in rows)
        src_BS = torch.full((len(rows), longest), self.tokenizer.pad_id, dtype=torch.long)
        mask_BS = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, row in enumerate(rows):
            src_BS[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask_BS[i, : len(row)] = True
        return src_BS.to(self.device), mask_BS.to(self.device)
