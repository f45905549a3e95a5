"""The project's tokenizer: a SentencePiece model with fixed special ids and language tags.

Vocabulary layout of every model trained by :func:`megasemface.data.text.spm_training.train_spm`::

    0 <unk>   1 <s>   2 </s>   3 <pad>   4 <mask>   5.. __xx__ (one per language, in the
    order given)   then extra control symbols, the 256 byte pieces, the learned pieces.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from megasemface.data.text.languages import lang_from_tag

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MASK_ID",
    "MASK_PIECE",
    "PAD_ID",
    "UNK_ID",
    "Tokenizer",
]

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_ID = 3
MASK_ID = 4
MASK_PIECE = "<mask>"


class Tokenizer:
    """A SentencePiece model with the project's conventions (special ids, language tags).

    Build it with :meth:`load` or :meth:`from_bytes`. It pickles as its model bytes, so it can
    be handed to worker processes.
    """

    def __init__(self, model_bytes: bytes, *, path: Path | None = None) -> None:
        """Use :meth:`load` or :meth:`from_bytes`; ``model_bytes`` is a serialized model."""
        if not isinstance(model_bytes, (bytes, bytearray, memoryview)):
            raise TypeError(f"model bytes expected, got {type(model_bytes).__name__}")
        model_bytes = bytes(model_bytes)
        where = f" {path}" if path is not None else ""
        if not model_bytes:
            raise ValueError(f"empty SentencePiece model{where}")
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, ValueError, OSError) as exc:
            raise ValueError(f"not a SentencePiece model{where}: {exc}") from exc
        if processor.GetPieceSize() == 0:
            raise ValueError(f"not a SentencePiece model{where}: no pieces")
        self._sp = processor
        self._model_bytes = model_bytes
        self._path = path
        self._sha256 = hashlib.sha256(model_bytes).hexdigest()
        size = processor.GetPieceSize()
        self._control_ids = frozenset(i for i in range(size) if processor.IsControl(i))
        # Languages are read back from the model, not from a side file, so a model always
        # knows which languages it was trained for.
        self._lang_ids: dict[str, int] = {}
        for i in sorted(self._control_ids):
            lang = lang_from_tag(processor.IdToPiece(i))
            if lang is not None:
                self._lang_ids[lang] = i

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads a ``.model`` file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a SentencePiece model.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        return cls(path.read_bytes(), path=path)

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """Builds a tokenizer from a serialized model (e.g. :attr:`model_bytes`)."""
        return cls(data)

    def __reduce__(self) -> tuple[Any, ...]:
        # SentencePieceProcessor itself is not reliably picklable; the bytes always are.
        return (_unpickle_tokenizer, (self._model_bytes, self._path))

    def __repr__(self) -> str:
        where = str(self._path) if self._path is not None else "<bytes>"
        return (
            f"Tokenizer({where}, vocab_size={self.vocab_size}, languages={self.languages}, "
            f"sha256={self._sha256[:12]})"
        )

    def __len__(self) -> int:
        return self.vocab_size

    # -- identity --------------------------------------------------------------------------

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The underlying SentencePiece processor (for anything not wrapped here)."""
        return self._sp

    @property
    def path(self) -> Path | None:
        """The file the model was loaded from; None when built from bytes."""
        return self._path

    @property
    def model_bytes(self) -> bytes:
        """The serialized model, e.g. to pass to worker processes."""
        return self._model_bytes

    @property
    def sha256(self) -> str:
        """Hex sha256 of the model bytes: identifies the tokenizer data was encoded with."""
        return self._sha256

    # -- vocabulary ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of pieces (ids are ``0 .. vocab_size - 1``)."""
        return int(self._sp.GetPieceSize())

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>`` (0 in models trained here)."""
        return int(self._sp.unk_id())

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (1 in models trained here)."""
        return self._required_id("bos", self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (2 in models trained here)."""
        return self._required_id("eos", self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>`` (3 in models trained here)."""
        return self._required_id("pad", self._sp.pad_id())

    @property
    def mask_id(self) -> int:
        """Id of the ``<mask>`` control symbol (4 in models trained here)."""
        mask = int(self._sp.PieceToId(MASK_PIECE))
        if mask not in self._control_ids:  # PieceToId answers unk_id for unknown pieces
            raise ValueError(f"this model has no {MASK_PIECE} control symbol")
        return mask

    def _required_id(self, name: str, value: int) -> int:
        if value < 0:  # SentencePiece's "disabled"
            raise ValueError(f"this model has no {name} piece")
        return int(value)

    @property
    def languages(self) -> list[str]:
        """Language codes whose tags are control pieces of the model, in id order."""
        return list(self._lang_ids)

    def lang_id(self, lang: str) -> int:
        """Id of a language's tag, e.g. ``lang_id("de")`` is the id of ``__de__``."""
        try:
            return self._lang_ids[lang]
        except KeyError:
            known = ", ".join(self._lang_ids) or "none"
            raise KeyError(
                f"language {lang!r} is not in this tokenizer (languages: {known})"
            ) from None

    @property
    def id_dtype(self) -> np.dtype[Any]:
        """Smallest unsigned dtype holding every id: uint16 up to 65,536 pieces."""
        return np.dtype(np.uint16 if self.vocab_size <= 65536 else np.uint32)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Encodes a batch of texts to ids (no bos/eos, no language tag added).

        ``num_threads`` > 1 lets SentencePiece encode the batch in parallel in C++.
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode takes a list of texts; wrap a single text in a list")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not texts:
            return []
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decodes ids to text, dropping pad, bos/eos, ``<mask>`` and language tags."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ValueError(f"decode takes one sequence of ids, got shape {ids.shape}")
            values = [int(i) for i in ids.tolist()]
        else:
            values = [int(i) for i in ids]
        size = self.vocab_size
        if values and (min(values) < 0 or max(values) >= size):
            bad = next(i for i in values if not 0 <= i < size)
            raise ValueError(f"id {bad} out of range for vocabulary size {size}")
        control = self._control_ids
        return self._sp.decode([i for i in values if i not in control])


def _unpickle_tokenizer(model_bytes: bytes, path: Path | None) -> Tokenizer:
    return Tokenizer(model_bytes, path=path)
