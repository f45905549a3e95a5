"""The streaming loader: exact resume, disjoint and complete splits, padding, bad data."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pathlib
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from megasemface.data.loading.loader import (
    DataError,
    LoaderConfig,
    ShardLoader,
    ShardSource,
    TokenBatch,
)
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import Manifest
from megasemface.data.text.languages import sampling_probs, temperature_probs
from megasemface.data.text.textio import parse_lang_path, parse_parallel

PAD = 3


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path) -> Path:
    out = tmp_path_factory.mktemp("shards")
    inputs = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    config = ShardBuildConfig(tokens_per_sample=2048, samples_per_shard=4)
    build_shards(parse_lang_path(inputs), spm_model, out, config)
    return out


def uneven_source(shard_dir: Path, en: int = 7, de: int = 5) -> ShardSource:
    """A subset with shard counts that do not divide by ranks x workers."""
    full = ShardSource.from_manifest(Manifest.load(shard_dir))
    shards = {"en": full.shards["en"][:en], "de": full.shards["de"][:de]}
    return ShardSource(shards, {"en": 3 * full.sizes["en"], "de": full.sizes["de"]}, 1000)


def config(**overrides: object) -> LoaderConfig:
    base = {"max_tokens": 512, "max_len": 64, "pool_tokens": 4096, "seed": 11}
    return LoaderConfig(**{**base, **overrides})  # type: ignore[arg-type]


def take(iterator: object, n: int) -> list[TokenBatch]:
    return [next(iterator) for _ in range(n)]  # type: ignore[call-overload]


def same(a: list[TokenBatch], b: list[TokenBatch]) -> bool:
    return all(
        x.lang == y.lang
        and torch.equal(x.tokens, y.tokens)
        and torch.equal(x.sentence_ids, y.sentence_ids)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_restored_loader_yields_exactly_the_next_batches(shard_dir: Path, workers: int) -> None:
    source = uneven_source(shard_dir)
    cfg = config(num_workers=workers)
    original = ShardLoader(source, cfg, pad_id=PAD, rank=1, world_size=2)
    stream = iter(original)
    take(stream, 57)  # crosses pools, shards and (for some slots) epochs
    state = json.loads(json.dumps(original.state_dict()))  # plain data, checkpoint-safe
    expected = take(stream, 41)

    restored = ShardLoader(source, cfg, pad_id=PAD, rank=1, world_size=2)
    restored.load_state_dict(state)
    assert same(take(iter(restored), 41), expected)

    # A fresh loader starts from the beginning, so the restore really moved it.
    fresh = take(iter(ShardLoader(source, cfg, pad_id=PAD, rank=1, world_size=2)), 41)
    assert not same(fresh, expected)


@pytest.mark.parametrize(("world_size", "workers"), [(1, 0), (2, 0), (3, 2), (2, 1)])
def test_epoch_splits_are_disjoint_and_complete(
    shard_dir: Path, world_size: int, workers: int
) -> None:
    source = uneven_source(shard_dir, en=7)
    source = ShardSource({"en": source.shards["en"]}, {"en": 1}, 1000)
    slots = world_size * max(1, workers)
    assert slots == 1 or len(source.shards["en"]) % slots != 0
    seen: Counter[int] = Counter()
    for rank in range(world_size):
        loader = ShardLoader(
            source, config(num_workers=workers), pad_id=PAD, rank=rank, world_size=world_size
        )
        finished: set[int] = set()
        for batch in loader:
            seen.update(batch.sentence_ids[batch.epochs == 0].tolist())
            # Pools may straddle an epoch boundary, so wait until a slot reaches epoch 2.
            if batch.epoch >= 2:
                finished.add(batch.slot)
            if len(finished) == max(1, workers):
                break
    # Every sentence of the 7 shards exactly once in epoch 0, over all ranks and workers.
    manifest = Manifest.load(shard_dir)
    expected = sum(
        s.sentences
        for s in manifest.shards
        if s.name in {Path(p).name for p in source.shards["en"]}
    )
    assert len(seen) == expected
    assert set(seen.values()) == {1}


def test_batches_respect_budget_and_are_mostly_real_tokens(shard_dir: Path) -> None:
    source = ShardSource.from_manifest(Manifest.load(shard_dir))
    cfg = LoaderConfig(max_tokens=2048, max_len=128, pool_tokens=1 << 18, seed=0)
    loader = ShardLoader(source, cfg, pad_id=PAD)
    real = padded = 0
    for batch in take(iter(loader), 300):
        assert batch.tokens.numel() <= cfg.max_tokens
        assert batch.tokens.dtype == torch.int64
        mask = torch.arange(batch.tokens.shape[1]) < batch.lengths[:, None]
        assert (batch.tokens[~mask] == PAD).all() and (batch.tokens[mask] != PAD).all()
        real += batch.num_tokens
        padded += batch.padded_tokens
    assert real / padded >= 0.9
    assert loader.stats()["tokens"] == real


def test_languages_are_mixed_by_temperature(shard_dir: Path) -> None:
    source = uneven_source(shard_dir)  # en is said to be 3x as large as its share
    cfg = config(temperature=2.0)
    counts = Counter(b.lang for b in take(iter(ShardLoader(source, cfg, pad_id=PAD)), 2000))
    probs = temperature_probs(source.sizes, 2.0)
    assert counts["en"] / 2000 == pytest.approx(probs["en"], abs=0.035)
    assert probs["en"] < source.sizes["en"] / sum(source.sizes.values())
    # What the run's MLflow record says of it: the temperature, the counts, the shares.
    sampling = ShardLoader(source, cfg, pad_id=PAD).sampling()
    assert sampling["temperature"] == 2.0
    assert sampling["languages"] == {
        lang: {"sentences": source.sizes[lang], "probability": probs[lang]} for lang in ("de", "en")
    }


def test_pairs_get_their_share_of_batches(
    tmp_path: Path, demo_corpus: Path, spm_model: Path
) -> None:
    """With ``pair_share``, the pairs together get that share of the batches whatever their
    size, each kind divided among its own by temperature; the fingerprint of a loader
    without the option is the one it had before the option existed."""
    mono = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    train = demo_corpus / "parallel" / "en-de" / "train"
    pairs = parse_parallel([f"en-de:{train}.en,{train}.de"])
    config_ = ShardBuildConfig(tokens_per_sample=2048, samples_per_shard=4, max_tokens=60)
    build_shards(parse_lang_path(mono) + pairs, spm_model, tmp_path / "mixed", config_)
    full = ShardSource.from_manifest(Manifest.load(tmp_path / "mixed"))
    # Fewer pairs than they are: 2000 beside 30000 and 20000 sentences.
    sizes = {"de": 20000, "en": 30000, "en-de": 2000}
    source = dataclasses.replace(full, sizes=sizes)
    assert sampling_probs(sizes, 2.0, ["en-de"]) == temperature_probs(sizes, 2.0)
    probs = sampling_probs(sizes, 2.0, ["en-de"], pair_share=0.5)
    mono_probs = temperature_probs({"en": 30000, "de": 20000}, 2.0)
    expected = {"en": mono_probs["en"] / 2, "de": mono_probs["de"] / 2, "en-de": 0.5}
    assert probs == pytest.approx(expected)
    assert temperature_probs(sizes, 2.0)["en-de"] < 0.15

    steps = 1000
    shared = ShardLoader(source, config(temperature=2.0, pair_share=0.5, max_len=128), pad_id=PAD)
    drawn = Counter(b.lang for b in take(iter(shared), steps))
    # The run's MLflow record gives the shares the batches are drawn with.
    recorded = shared.sampling()
    assert recorded["pair_share"] == 0.5
    assert {k: v["probability"] for k, v in recorded["languages"].items()} == probs
    # Binomial: 4 standard deviations of a share of 0.5 over 1000 draws is 0.063.
    assert drawn["en-de"] / steps == pytest.approx(0.5, abs=0.063)
    assert drawn["en"] / steps == pytest.approx(probs["en"], abs=0.063)
    # Only one kind: the share has nothing to divide.
    assert sampling_probs({"en": 3, "de": 1}, 2.0, [], 0.5) == temperature_probs(
        {"en": 3, "de": 1}, 2.0
    )
    plain = ShardLoader(source, config(max_len=128), pad_id=PAD).fingerprint
    assert "pair_share" not in json.dumps(config().order_fields())
    assert ShardLoader(source, config(pair_share=0.5, max_len=128), pad_id=PAD).fingerprint != plain
    with pytest.raises(ValueError, match="pair_share must be in"):
        config(pair_share=1.0)


def run_ranks(
    source: ShardSource,
    world_size: int,
    workers: int,
    steps: int,
    states: list[dict] | None = None,
) -> tuple[dict[int, TokenBatch], list[dict]]:
    """``steps`` batches on each of ``world_size`` ranks (from ``states``, the saved states of
    all ranks of an earlier run), keyed by global batch; and the ranks' states after them."""
    taken: dict[int, TokenBatch] = {}
    saved = []
    for rank in range(world_size):
        loader = ShardLoader(
            source, config(num_workers=workers), pad_id=PAD, rank=rank, world_size=world_size
        )
        if states is not None:
            loader.load_states(states)
        stream = iter(loader)
        for _ in range(steps):
            where = loader.position + rank
            assert where not in taken
            taken[where] = next(stream)
        saved.append(json.loads(json.dumps(loader.state_dict())))  # as checkpoints hold it
    return taken, saved


@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 0), (1, 0)), ((1, 0), (2, 0)), ((3, 0), (2, 0)), ((2, 1), (3, 2))],
)
def test_another_number_of_ranks_reads_every_global_batch_once(
    shard_dir: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    """Stopped after 7 steps on ``before`` (ranks, workers) and resumed on ``after``: the
    ranks together read each batch of the uninterrupted run once, none twice, none skipped."""
    source = uneven_source(shard_dir)
    (world, workers), (new_world, new_workers) = before, after
    first, states = run_ranks(source, world, workers, 7)
    second, _ = run_ranks(source, new_world, new_workers, 9, states)
    total = 7 * world + 9 * new_world
    assert sorted([*first, *second]) == list(range(total))  # disjoint and complete
    reference, _ = run_ranks(source, world, 0, -(-total // world))
    assert all(same([first[g]], [reference[g]]) for g in first)
    assert all(same([second[g]], [reference[g]]) for g in second)


def test_a_resume_late_in_the_epoch_seeks_instead_of_replaying(
    shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume at 80% of a 50M-sentence epoch costs what reading one shard costs: the
    restored loader opens the shard it stopped in and those the next batches need, never the
    shards before (benchmarks/bench_scale.py times it at scale)."""
    source = ShardSource.from_manifest(Manifest.load(shard_dir)).select(("en",))
    original = ShardLoader(source, config(), pad_id=PAD)
    stream = iter(original)
    seen = 0
    while seen < 0.8 * source.sizes["en"]:
        seen += int((next(stream).epochs == 0).sum())
    state = json.loads(json.dumps(original.state_dict()))
    expected = take(stream, 5)

    opened: list[str] = []
    shard_list = wds.SimpleShardList

    def recording(urls: list[str], *args: object, **kwargs: object) -> object:
        opened.extend(urls)
        return shard_list(urls, *args, **kwargs)

    monkeypatch.setattr(wds, "SimpleShardList", recording)
    restored = ShardLoader(source, config(), pad_id=PAD)
    restored.load_state_dict(state)
    assert same(take(iter(restored), 5), expected)
    assert 1 <= len(opened) <= 3 < 0.8 * len(source.shards["en"])


def test_state_of_the_first_format_resumes_exactly(shard_dir: Path) -> None:
    """A checkpoint written before positions were global (version 1: slot states keyed by
    worker) resumes where it stopped."""
    source = uneven_source(shard_dir)
    original = ShardLoader(source, config(), pad_id=PAD, rank=1, world_size=2)
    stream = iter(original)
    take(stream, 23)
    state = original.state_dict()
    old = {
        "version": 1,
        "fingerprint": state["fingerprint"],
        "rank": 1,
        "world_size": 2,
        "workers": 1,
        "next_worker": 0,
        "slots": {"0": state["slots"]["1"]},
    }
    restored = ShardLoader(source, config(), pad_id=PAD, rank=1, world_size=2)
    restored.load_state_dict(old)
    assert same(take(iter(restored), 9), take(stream, 9))


def test_state_of_other_data_or_options_is_refused(shard_dir: Path) -> None:
    source = uneven_source(shard_dir)
    loader = ShardLoader(source, config(num_workers=0), pad_id=PAD)
    take(iter(loader), 3)
    reseeded = ShardLoader(source, config(seed=12), pad_id=PAD)
    with pytest.raises(ValueError, match="other shards or batching options"):
        reseeded.load_state_dict(loader.state_dict())
    ahead = ShardLoader(source, config(num_workers=0), pad_id=PAD, rank=1, world_size=2)
    take(iter(ahead), 1)
    with pytest.raises(ValueError, match="not saved at the same step"):
        loader.load_states([loader.state_dict(), ahead.state_dict()])


def _copy_shards(shard_dir: Path, tmp_path: Path) -> ShardSource:
    source = uneven_source(shard_dir, en=4, de=1)
    copies = {}
    for lang, urls in source.shards.items():
        copies[lang] = []
        for url in urls:
            target = tmp_path / Path(url).name
            shutil.copy(url, target)
            copies[lang].append(str(target))
    return ShardSource(copies, source.sizes, 1000)


def test_bad_shards_are_skipped_counted_and_fatal_above_the_rate(
    shard_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _copy_shards(shard_dir, tmp_path)
    truncated = Path(source.shards["en"][1])
    truncated.write_bytes(truncated.read_bytes()[:3000])
    garbled = Path(source.shards["en"][2])
    data = bytearray(garbled.read_bytes())
    data[1536:1600] = b"\x00" * 64  # inside the first lengths.npy.gz member
    garbled.write_bytes(bytes(data))

    tolerant = config(max_bad_fraction=0.5, languages=("en",), shuffle=False)
    loader = ShardLoader(source, tolerant, pad_id=PAD)
    with caplog.at_level(logging.WARNING):
        batches = take(iter(loader), 400)  # more than one epoch of the four shards
    assert loader.stats()["bad"] >= 2
    assert str(truncated) in caplog.text and str(garbled) in caplog.text
    assert max(b.epoch for b in batches) >= 1

    strict = config(max_bad_fraction=0.0, bad_sample_grace=0, languages=("en",), shuffle=False)
    with pytest.raises(DataError, match=re.escape(str(truncated))):
        take(iter(ShardLoader(source, strict, pad_id=PAD)), 400)


class _Exploit:
    """Unpickling this would create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickled_members_are_never_decoded(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = np.empty(1, dtype=object)
    evil[0] = _Exploit(marker)
    buffer = io.BytesIO()
    np.save(buffer, evil, allow_pickle=True)
    shard = tmp_path / "en-000000.tar"
    with wds.TarWriter(str(shard), encoder=False) as writer:
        writer.write(
            {
                "__key__": "en-000000-000000",
                "tokens.npy": buffer.getvalue(),
                "lengths.npy.gz": __import__("gzip").compress(buffer.getvalue()),
                "json": b'{"lang": "en", "sentences": 1, "tokens": 1, "first_sentence": 0}',
                "pyd": __import__("pickle").dumps(_Exploit(marker)),
            }
        )
    source = ShardSource({"en": [str(shard)]}, {"en": 1}, 1000)
    loader = ShardLoader(source, config(bad_sample_grace=0, max_bad_fraction=0.0), pad_id=PAD)
    with pytest.raises(DataError, match=r"not a valid \.npy"):
        next(iter(loader))
    assert not marker.exists()


def test_ids_outside_the_vocabulary_mean_another_tokenizer(shard_dir: Path) -> None:
    source = uneven_source(shard_dir)
    narrow = ShardSource(source.shards, source.sizes, vocab_size=50)
    loader = ShardLoader(narrow, config(bad_sample_grace=0, max_bad_fraction=0.0), pad_id=PAD)
    with pytest.raises(DataError, match="another SentencePiece model"):
        next(iter(loader))


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_are_handed_over_pinned_where_a_gpu_copies_them(
    shard_dir: Path, workers: int
) -> None:
    """In page-locked memory on a CUDA machine (so the step's copy to the device does not
    wait for the device), in ordinary memory elsewhere (there is nothing to pin for)."""
    loader = ShardLoader(uneven_source(shard_dir), config(num_workers=workers), pad_id=PAD)
    for batch in take(iter(loader), 3):
        for tensor in (batch.tokens, batch.lengths, batch.sentence_ids):
            assert tensor.is_pinned() == torch.cuda.is_available()
