"""Damaged files never escape as a stray exception: random bytes, truncations and bit flips.

The corpus reader, the shard decoder (for tools and for training) and the model-directory
loader each either read a damaged file (a bit flip in text or in weights is still data) or
raise the project's own error, whose one-line message the tools print. Any other exception
type would reach the user as a traceback.

Examples are derived from a fixed seed (``derandomize``), so a run is repeatable; each test
writes its example into one scratch file and reads it back with the real reader.
"""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import lzma
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megasemface.data.loading.loader import DataError, LoaderConfig, ShardLoader, ShardSource
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import (
    Manifest,
    ShardFormatError,
    decode_sample,
    encode_sample,
    iter_shard_chunks,
)
from megasemface.data.text.textio import CorpusReadError, LineReader, parse_lang_path, split_lines
from megasemface.export.source import load_export_source
from megasemface.models.model_dir import ModelDirError, load_model_dir, load_seq2seq

PROPERTY = settings(
    derandomize=True,
    deadline=None,
    max_examples=100,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL_PROPERTY = settings(PROPERTY, max_examples=50)  # a model load takes up to 0.3 s

TEXT = "".join(
    f"Line {i}: Die Datei „{i}.txt“ konnte nicht geöffnet werden 🙂\r\n"
    if i % 7 == 0
    else f"line {i} of the corpus\n"
    for i in range(300)
).encode("utf-8")

COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    ".txt": lambda data: data,
    ".gz": lambda data: gzip.compress(data, mtime=0),
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
    ".zst": lambda data: zstandard.ZstdCompressor().compress(data),
}


def _flip(data: bytes, bits: list[int]) -> bytes:
    out = bytearray(data)
    for bit in bits:
        out[bit // 8 % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def damaged(data: st.DataObject, valid: bytes, random_size: int = 512) -> bytes:
    """Random bytes, ``valid`` cut at any point, or ``valid`` with one to four bits flipped."""
    kind = data.draw(st.sampled_from(["random", "truncated", "flipped"]), label="damage")
    event(kind)
    if kind == "random":
        return data.draw(st.binary(max_size=random_size), label="bytes")
    if kind == "truncated":
        return valid[: data.draw(st.integers(0, len(valid) - 1), label="cut at")]
    bits = st.lists(st.integers(0, 8 * len(valid) - 1), min_size=1, max_size=4)
    return _flip(valid, data.draw(bits, label="flipped bits"))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The examples' files (hypothesis runs a test body many times, which a function-scoped
    tmp_path would not follow; each example overwrites the file of the one before)."""
    return tmp_path_factory.mktemp("damaged")


# Corpus reader ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", list(COMPRESS))
@PROPERTY
@given(data=st.data())
def test_corpus_reader_reads_or_raises_corpus_read_error(
    scratch: Path, suffix: str, data: st.DataObject
) -> None:
    path = scratch / f"corpus{suffix}"
    path.write_bytes(damaged(data, COMPRESS[suffix](TEXT)))
    try:
        with LineReader(path) as reader:
            lines = list(reader)
    except CorpusReadError as exc:
        event("CorpusReadError")
        assert str(path) in str(exc)
        return
    event("read")
    assert all(isinstance(line, bytes) for line in lines)
    with LineReader(path) as reader:  # blocks hold the same lines
        blocks = list(reader.iter_blocks(256))
    assert [line for block in blocks for line in split_lines(block)] == lines


# Shard decoder ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard(spm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """A small real shard of several samples, from the shard builder: its bytes and the
    vocabulary size of the manifest."""
    root = tmp_path_factory.mktemp("shard")
    corpus = root / "de.txt"
    corpus.write_bytes(b"".join(f"Satz {i}: Datei {i % 13} öffnen\n".encode() for i in range(60)))
    config = ShardBuildConfig(tokens_per_sample=200, samples_per_shard=64, jobs=1)
    build_shards(parse_lang_path([f"de:{corpus}"]), spm_model, root / "shards", config)
    manifest = Manifest.load(root / "shards")
    (info,) = manifest.shards
    assert info.samples >= 3
    return (root / "shards" / info.name).read_bytes(), manifest.vocab_size


@PROPERTY
@given(data=st.data())
def test_shard_decoder_reads_or_raises_shard_format_error(
    shard: tuple[bytes, int], scratch: Path, data: st.DataObject
) -> None:
    """What tools read whole shards with (megasemface.embeddings)."""
    valid, vocab_size = shard
    path = scratch / "de-000000.tar"
    path.write_bytes(damaged(data, valid, random_size=2048))
    try:
        chunks = list(iter_shard_chunks(path, vocab_size))
    except ShardFormatError as exc:
        event("ShardFormatError")
        assert str(path) in str(exc)
        return
    event("read")
    assert all(chunk.lang == "de" for chunk in chunks)


@PROPERTY
@given(data=st.data())
def test_shard_loader_reads_or_raises_data_error(
    shard: tuple[bytes, int], scratch: Path, data: st.DataObject
) -> None:
    """Training reads a damaged shard by skipping what it cannot read; with nothing readable
    it stops with a DataError."""
    valid, vocab_size = shard
    path = scratch / "loader-de-000000.tar"
    path.write_bytes(damaged(data, valid, random_size=2048))
    source = ShardSource({"de": [str(path)]}, {"de": 60}, vocab_size)
    config = LoaderConfig(max_tokens=256, max_len=64, pool_tokens=512)
    try:
        batches = list(itertools.islice(ShardLoader(source, config, pad_id=3), 3))
    except DataError:
        event("DataError")
        return
    event("read")
    assert all(batch.lang == "de" and batch.tokens.shape[0] > 0 for batch in batches)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)


@PROPERTY
@given(
    meta=st.fixed_dictionaries(
        {},
        optional={
            key: st.just(right) | JSON_VALUES
            for key, right in {
                "lang": "de",
                "sentences": 1,
                "tokens": 3,
                "first_sentence": 0,
            }.items()
        },
    ),
    member=st.sampled_from(["json", "tokens.npy", "lengths.npy.gz"]),
    data=st.binary(max_size=64),
)
def test_sample_decoder_reads_or_raises_shard_format_error(
    meta: dict[str, Any], member: str, data: bytes
) -> None:
    """A sample whose json member has any value in any field, then also one member of
    random bytes."""
    sample = encode_sample("de-0-0", "de", np.array([5, 6, 7], np.uint16), np.array([3]), 0)
    sample["json"] = json.dumps(meta).encode()
    for damaged_member in (None, member):
        if damaged_member is not None:
            sample[damaged_member] = data
        try:
            decode_sample(sample, vocab_size=100)
            event("decoded")
        except ShardFormatError:
            event("ShardFormatError")


# Model directory -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(launch_data: dict, scratch: Path) -> tuple[Path, dict[str, bytes]]:
    """A copy of a real translation model directory, and its files' bytes."""
    path = scratch / "model"
    shutil.copytree(launch_data["init"], path)
    return path, {name: (path / name).read_bytes() for name in ("model.safetensors", "config.json")}


def _loads_or_model_dir_error(path: Path) -> None:
    """What translate, fine-tuning and export read of a model directory: each loads it, or
    raises a ModelDirError naming it."""
    for load in (
        lambda: load_model_dir(path, "seq2seq"),
        lambda: load_seq2seq(path),
        lambda: load_export_source(path, "en", "de"),
    ):
        try:
            load()
            event("loaded")
        except ModelDirError as exc:
            event("ModelDirError")
            assert str(path) in str(exc)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
@MODEL_PROPERTY
@given(data=st.data())
def test_model_dir_loads_or_raises_model_dir_error(
    model_dir: tuple[Path, dict[str, bytes]], name: str, data: st.DataObject
) -> None:
    path, valid = model_dir
    for other, content in valid.items():
        (path / other).write_bytes(content)
    (path / name).write_bytes(damaged(data, valid[name]))
    _loads_or_model_dir_error(path)


def _replace(config: dict[str, Any], keys: tuple[str, ...], value: Any) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    node = config
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return config


@MODEL_PROPERTY
@given(data=st.data(), value=JSON_VALUES)
def test_model_dir_config_fields_of_any_value(
    model_dir: tuple[Path, dict[str, bytes]], data: st.DataObject, value: Any
) -> None:
    """config.json with any JSON value in any field, the model's shapes included: a shape
    that does not match the weights is refused before a model of that shape is built."""
    path, valid = model_dir
    config = json.loads(valid["config.json"])
    fields = [(key,) for key in config] + [("model", key) for key in config["model"]]
    fields += [("model", "vq", key) for key in config["model"]["vq"]]
    keys = data.draw(st.sampled_from(fields), label="field")
    (path / "model.safetensors").write_bytes(valid["model.safetensors"])
    (path / "config.json").write_text(json.dumps(_replace(config, keys, value)), encoding="utf-8")
    _loads_or_model_dir_error(path)
