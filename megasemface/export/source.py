"""What every export reads: a translation model directory, fixed to one direction.

megasemface adds a language embedding at every position (the source language's in the
encoder, the target language's in the decoder). Once the direction is fixed that embedding
is a constant vector per stack, so it folds exactly into the learned position table:
``token + position + language == token + (position + language)`` up to the order of two
float additions. The exported models thus need no language input and are standard
Transformers, one export per direction.

Everything else maps one to one: pre-norm layers with one final LayerNorm per stack, a
LayerNorm after the embeddings, no embedding scale, learned positions from 0, exact GELU,
separate encoder and decoder token embeddings, and an output layer tied to the decoder's
token embeddings with its own bias.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.inference.translate import banned_ids
from megasemface.models.model_dir import (
    ModelDirError,
    ModelDirInfo,
    load_seq2seq_state,
    read_model_dir_info,
)
from megasemface.nn.config import ModelConfig

__all__ = ["ExportError", "ExportSource", "load_export_source"]


class ExportError(ValueError):
    """A model directory cannot be exported as asked."""


@dataclasses.dataclass
class ExportSource:
    """The weights, tokenizer and metadata of one direction of a ``seq2seq`` directory."""

    info: ModelDirInfo
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    src_lang: str
    tgt_lang: str

    @property
    def config(self) -> ModelConfig:
        return self.info.model

    @property
    def direction(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"

    @property
    def tgt_tag_id(self) -> int:
        """The decoder's first token: the target language's tag."""
        return self.tokenizer.lang_id(self.tgt_lang)

    @property
    def suppressed_ids(self) -> list[int]:
        """Ids megasemface's search never generates; exported generation suppresses them."""
        return banned_ids(self.tokenizer, self.config.vocab_size)

    def positions(self, stack: str) -> torch.Tensor:
        """The [max_len, D] position table of ``encoder`` or ``decoder`` with the fixed
        language's embedding folded in."""
        lang = self.src_lang if stack == "encoder" else self.tgt_lang
        index = self.info.languages.index(lang)
        languages = self.state[f"{stack}.embed.languages.weight"]
        return self.state[f"{stack}.embed.positions.weight"] + languages[index]

    def provenance(self) -> dict[str, Any]:
        path = self.info.path / "provenance.json"
        try:
            return dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return {}


def load_export_source(
    model_dir: str | os.PathLike[str], src_lang: str, tgt_lang: str
) -> ExportSource:
    """Reads a ``seq2seq`` model directory for the direction ``src_lang`` -> ``tgt_lang``.

    Raises:
        ModelDirError: not a complete translation model directory (a pre-training directory,
            a missing SentencePiece model, weights that do not match the config).
        ExportError: a model exports cannot express, or a language it does not have.
    """
    info = read_model_dir_info(model_dir, "seq2seq")
    if info.model.bridge != "none":
        # The codebook bridge is a softmax over the VQ codebook between encoder and
        # decoder: no standard architecture has it, and it does not fold into weights.
        raise ExportError(
            f"{info.path} has the {info.model.bridge!r} bridge between encoder and decoder, "
            "which transformers and CTranslate2 have no layer for; export a model connected "
            "without --bridge"
        )
    if info.model.fusion != "none":
        # Every decoder layer cross-attends to its own memory, which the coordinator mixes
        # from all the encoder's layers: no transformers class or CTranslate2 spec has that.
        raise ExportError(
            f"{info.path} is a deep-fusion model (a layer-wise coordinator between encoder and "
            "decoder), which transformers and CTranslate2 have no layer for; translate with "
            "megasemface (tools/translate.py --model-dir)"
        )
    for lang in (src_lang, tgt_lang):
        if lang not in info.languages:
            raise ExportError(
                f"language {lang!r} is not one of the languages of {info.path}: "
                f"{', '.join(info.languages)}"
            )
    if src_lang == tgt_lang:
        raise ExportError(f"source and target language are both {src_lang!r}")
    tokenizer = Tokenizer.load(info.spm_model)
    if tokenizer.languages != info.languages:
        raise ModelDirError(
            f"{info.path}/config.json lists languages {info.languages}, its spm.model "
            f"{tokenizer.languages}"
        )
    state, info = load_seq2seq_state(model_dir)  # names and shapes as the config says
    return ExportSource(info, state, tokenizer, src_lang, tgt_lang)
