"""The on-disk format of token shards and their manifest.

A shard is a plain webdataset tar file. Each webdataset sample packs many sentences of one
language, because a tar member per sentence would cost a 512-byte header plus padding to
512 bytes: about 17x the size of a 30-token sentence stored as uint16. A sample with key
``<lang>-<shard>-<sample>`` has three members:

- ``tokens.npy``: the token ids of all its sentences concatenated (uint16 when the
  vocabulary has at most 65,536 ids, else uint32);
- ``lengths.npy.gz``: the number of tokens of each sentence (uint8, uint16 or uint32, the
  smallest that fits), gzip-compressed; sentence offsets are the cumulative sum of the
  lengths, stored this way because lengths of nearby sentences compress to a few bits each,
  where offsets would cost four bytes (a 10-token sentence: 0.4 bytes per token);
- ``json``: ``{"lang", "sentences", "tokens", "first_sentence"}``, where ``first_sentence``
  is the index in the shard of the sample's first sentence.

Members are decoded with ``numpy.load(allow_pickle=False)`` and ``json.loads`` only: no
pickle is ever decoded. ``manifest.json`` beside the shards lists every shard with its
language, counts and sha256, the SentencePiece model's hash and the filter counts.

A parallel corpus is stored as one more "language" named after its pair (``en-de``), whose
sentences are pairs: ``source ids + [separator] + target ids`` (``megasemface.data.loading.pairs``
splits them). Its manifest entry has ``"pair": {"src", "tgt", "separator_id",
"max_length"}`` (``PairLayout``), and its line and sentence counts count pairs.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megasemface.files import atomic_write_text

__all__ = [
    "FORMAT_VERSION",
    "Chunk",
    "Manifest",
    "PairLayout",
    "ShardFormatError",
    "ShardInfo",
    "decode_sample",
    "encode_sample",
    "iter_shard_chunks",
    "write_json_atomic",
]

FORMAT_VERSION = 1


class ShardFormatError(ValueError):
    """A shard sample or manifest does not follow the format."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """The sentences of one shard sample: ``tokens[offsets[i]:offsets[i + 1]]`` is sentence i."""

    lang: str
    tokens: np.ndarray
    offsets: np.ndarray
    first_sentence: int

    @property
    def num_sentences(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _smallest_uint(max_value: int) -> type[np.unsignedinteger]:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return dtype
    return np.uint64


def encode_sample(
    key: str, lang: str, tokens: np.ndarray, lengths: np.ndarray, first_sentence: int
) -> dict[str, Any]:
    """Builds the webdataset sample (a dict of bytes) for sentences of one language."""
    if "." in key:
        raise ValueError(f"a sample key must not contain '.', got {key!r}")
    lengths = np.asarray(lengths)
    meta = {
        "lang": lang,
        "sentences": len(lengths),
        "tokens": len(tokens),
        "first_sentence": first_sentence,
    }
    return {
        "__key__": key,
        "tokens.npy": _npy_bytes(tokens),
        "lengths.npy.gz": gzip.compress(
            _npy_bytes(lengths.astype(_smallest_uint(int(lengths.max(initial=0))))),
            compresslevel=6,
            mtime=0,  # reproducible bytes
        ),
        "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
    }


def _load_npy(data: Any, field: str) -> np.ndarray:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ShardFormatError(f"member {field} is missing or not raw bytes")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError, OSError or EOFError on bad bytes
        raise ShardFormatError(f"member {field} is not a valid .npy array: {exc}") from exc
    if array.ndim != 1 or array.dtype.kind != "u":
        raise ShardFormatError(f"member {field} must be a 1-D unsigned array, got {array.dtype}")
    return array


def _gunzip(data: Any, sentences: int) -> bytes | None:
    """Decompresses a member, refusing to inflate past what its sentence count allows."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    limit = 256 + 4 * max(sentences, 0)  # npy header + uint32 per sentence at most
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(bytes(data), limit)
    except zlib.error as exc:
        raise ShardFormatError(f"member lengths.npy.gz is not valid gzip: {exc}") from exc
    if inflater.unconsumed_tail:
        raise ShardFormatError("member lengths.npy.gz inflates past its sentence count")
    return out


def decode_sample(sample: dict[str, Any], vocab_size: int | None = None) -> Chunk:
    """Decodes and validates a raw webdataset sample (bytes per member) into a Chunk."""
    key = sample.get("__key__", "?")
    try:
        meta = json.loads(bytes(sample["json"]).decode("utf-8"))
    except KeyError as exc:
        raise ShardFormatError(f"sample {key}: member json is missing") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"sample {key}: member json is not valid JSON: {exc}") from exc
    counts = ("sentences", "tokens", "first_sentence")
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("lang"), str)
        or not all(type(meta.get(name)) is int for name in counts)
    ):
        raise ShardFormatError(
            f"sample {key}: member json needs lang (a string) and integer sentences, tokens "
            "and first_sentence"
        )
    tokens = _load_npy(sample.get("tokens.npy"), "tokens.npy")
    lengths = _load_npy(_gunzip(sample.get("lengths.npy.gz"), meta["sentences"]), "lengths.npy.gz")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if (
        offsets[-1] != len(tokens)
        or meta["sentences"] != len(lengths)
        or meta["tokens"] != len(tokens)
    ):
        raise ShardFormatError(f"sample {key}: lengths, tokens and json counts disagree")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise ShardFormatError(
            f"sample {key}: token id {int(tokens.max())} >= vocabulary size {vocab_size}; "
            "the shards were built with another SentencePiece model"
        )
    return Chunk(meta["lang"], tokens, offsets, meta["first_sentence"])


def iter_shard_chunks(
    path: str | os.PathLike[str], vocab_size: int | None = None
) -> Iterator[Chunk]:
    """Every sample of one shard, decoded, in order.

    For tools that read whole shards; training reads through the loader, which skips and
    counts bad samples instead. A shard that cannot be read to its end (a truncated or damaged
    tar file) or a bad sample raises ShardFormatError naming the shard.
    """
    import webdataset as wds  # imported here: the format itself needs only numpy

    errors: list[BaseException] = []

    def stop(exn: BaseException) -> bool:  # webdataset's handler: keep the error, stop reading
        errors.append(exn)
        return False

    def check() -> None:
        if errors:
            raise ShardFormatError(
                f"{path} cannot be read as a tar file ({_tar_error(errors[0])}); the shard is "
                "truncated or damaged: rebuild it with tools/build_shards.py"
            )

    pipeline = wds.DataPipeline(
        wds.SimpleShardList([str(path)]), wds.tarfile_to_samples(handler=stop)
    )
    for raw in pipeline:
        check()  # a sample read before an error may be incomplete
        try:
            yield decode_sample(raw, vocab_size)
        except ShardFormatError as exc:
            raise ShardFormatError(f"{path}: {exc}; rebuild the shard") from None
    check()


def _tar_error(exn: BaseException) -> str:
    """What went wrong, without the stream and URL that webdataset appends to the message."""
    first = str(exn.args[0]).split(" @ ", 1)[0] if exn.args else ""
    return f"{type(exn).__name__}: {first}" if first else type(exn).__name__


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes JSON as manifests and build reports are written, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest."""

    name: str
    lang: str
    samples: int
    sentences: int
    tokens: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class PairLayout:
    """How the sentences of a language pair's entry are stored."""

    src: str
    """The source language (its ids come first)."""
    tgt: str
    """The target language (its ids follow the separator)."""
    separator_id: int
    """The id between the two sides (the tokenizer's eos, which encoding never produces)."""
    max_length: int
    """The longest pair the shards may hold: both sides at most ``max_tokens``, plus one."""

    @classmethod
    def from_json(cls, entry: Any) -> PairLayout:
        layout = cls(**entry)
        if not (
            isinstance(layout.src, str)
            and isinstance(layout.tgt, str)
            and isinstance(layout.separator_id, int)
            and isinstance(layout.max_length, int)
        ):
            raise TypeError(f"pair layout with wrong field types: {entry!r}")
        return layout


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a shard directory holds; written by the shard builder, read by the loader.

    ``languages`` has an entry per language and per language pair (whose sentences are
    pairs); ``pair_layouts`` (and ``pairs``) tell the pairs apart.
    """

    root: Path
    shards: tuple[ShardInfo, ...]
    vocab_size: int
    spm_sha256: str
    languages: dict[str, dict[str, Any]]
    raw: dict[str, Any]
    pair_layouts: dict[str, PairLayout] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        """Reads ``manifest.json`` (or the directory holding it) and checks its shards exist."""
        path = Path(path)
        if path.is_dir():
            path = path / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no shard manifest at {path}; build shards with tools/build_shards.py"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format_version") != FORMAT_VERSION:
                raise ShardFormatError(
                    f"{path}: format_version {raw.get('format_version')!r}, "
                    f"this megasemface reads {FORMAT_VERSION}; rebuild the shards"
                )
            shards = tuple(ShardInfo(**entry) for entry in raw["shards"])
            manifest = cls(
                root=path.parent,
                shards=shards,
                vocab_size=int(raw["spm"]["vocab_size"]),
                spm_sha256=str(raw["spm"]["sha256"]),
                languages=dict(raw["languages"]),
                raw=raw,
                pair_layouts={
                    name: PairLayout.from_json(entry["pair"])
                    for name, entry in raw["languages"].items()
                    if "pair" in entry
                },
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ShardFormatError(f"{path} is not a valid shard manifest: {exc!r}") from exc
        missing = [s.name for s in shards if not (path.parent / s.name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} lists {len(missing)} shard(s) that do not exist, e.g. {missing[0]}; "
                "rerun the shard build to complete it"
            )
        return manifest

    def shard_paths(self, lang: str) -> list[str]:
        """The shard files of one language, in build order."""
        if lang not in self.languages:
            raise KeyError(
                f"language {lang!r} not in the manifest; it has {sorted(self.languages)}"
            )
        return [str(self.root / s.name) for s in self.shards if s.lang == lang]

    def sentences(self, lang: str) -> int:
        """Sentences (pairs, for a language pair) of a language's shards."""
        return sum(s.sentences for s in self.shards if s.lang == lang)

    def profile(self) -> dict[str, Any]:
        """Counts of what the shards hold, per language (or pair) and in all: sentences,
        tokens and shards."""
        per_lang = {
            lang: {
                "sentences": self.sentences(lang),
                "tokens": sum(s.tokens for s in self.shards if s.lang == lang),
                "shards": sum(1 for s in self.shards if s.lang == lang),
            }
            for lang in self.languages
        }
        totals = {
            key: sum(counts[key] for counts in per_lang.values())
            for key in ("sentences", "tokens", "shards")
        }
        return {**totals, "languages": per_lang}

    @property
    def pairs(self) -> dict[str, tuple[str, str]]:
        """The entries that hold pairs: name (``en-de``) -> (source, target) language."""
        return {name: (p.src, p.tgt) for name, p in self.pair_layouts.items()}
