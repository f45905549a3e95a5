"""The SentencePiece model as a Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``).

A fast tokenizer rather than transformers' SentencePiece-backed one: the latter decodes byte
fallback pieces (``<0xC5>``) as text, so any character outside the learned pieces would come
back garbled. The pipeline rebuilds SentencePiece's own steps from its model file:

- normalisation: the model's precompiled character map (``nmt_nfkc``), then its whitespace
  rules (strip the ends, collapse runs of spaces) when the model has them;
- the ``▁`` word-boundary marker, prepended when the model adds a dummy prefix, and pieces
  never crossing a word boundary (SentencePiece's ``split_by_whitespace``);
- the BPE merges in the order of the pieces' scores (SentencePiece merges the best-scored
  pair first; transformers' ``generate_merges``), or the unigram pieces with their scores;
  byte fallback for the rest;
- control symbols (``<mask>``, the language tags) as special tokens, so that decoding with
  ``skip_special_tokens`` drops the target-language tag as megasemface's decoding does;
- ``</s>`` appended to every input: the encoder reads ``x </s>``.

tests/test_export.py checks that it encodes and decodes test sentences exactly as
SentencePiece does.
"""

from __future__ import annotations

from typing import Any

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.export.source import ExportError

__all__ = ["build_hf_tokenizer"]

_BPE, _UNIGRAM = 2, 1
_CONTROL = 3
_BOUNDARY = "▁"


def build_hf_tokenizer(tokenizer: Tokenizer, model_max_length: int) -> Any:
    """A ``PreTrainedTokenizerFast`` equivalent to ``tokenizer`` on text, plus ``</s>``."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE, Unigram
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto.FromString(tokenizer.model_bytes)
    pieces = [(p.piece, p.score) for p in proto.pieces]
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    unk = pieces[tokenizer.unk_id][0]
    if trainer.model_type == _BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = BPE(
            vocab,
            generate_merges(vocab, dict(pieces)),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    elif trainer.model_type == _UNIGRAM:
        model = Unigram(pieces, unk_id=tokenizer.unk_id, byte_fallback=trainer.byte_fallback)
    else:
        raise ExportError(
            f"SentencePiece model type {trainer.model_type} has no tokenizers equivalent "
            "(bpe and unigram have)"
        )
    raw = RawTokenizer(model)
    steps = []
    if normalizer.precompiled_charsmap:
        steps.append(normalizers.Precompiled(normalizer.precompiled_charsmap))
    if normalizer.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        raw.normalizer = normalizers.Sequence(steps)
    prepend = "always" if normalizer.add_dummy_prefix else "never"
    raw.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_BOUNDARY, prepend_scheme=prepend, split=trainer.split_by_whitespace
    )
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace(_BOUNDARY, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if normalizer.add_dummy_prefix else []),
        ]
    )
    raw.add_special_tokens(
        [
            AddedToken(p.piece, normalized=False, special=True)
            for p in proto.pieces
            if p.type == _CONTROL
        ]
    )
    eos = pieces[tokenizer.eos_id][0]
    raw.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, tokenizer.eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=pieces[tokenizer.bos_id][0],
        eos_token=eos,
        unk_token=unk,
        pad_token=pieces[tokenizer.pad_id][0],
        mask_token=pieces[tokenizer.mask_id][0],
        model_max_length=model_max_length,
        padding_side="right",
    )
