"""Streaming loader of token shards with exact mid-epoch resume.

Layout of the stream. A run reads ``S = world_size x max(1, num_workers)`` *slots*, fixed when
it starts (one per DataLoader worker of each data-parallel rank). For each language the
shards form an endless sequence of epochs, each a seeded permutation of the shard list; slot
``s`` reads positions ``s, s + S, s + 2S, ...`` of that sequence. So the slots split every
epoch's shards disjointly and completely, whatever the shard count, and no slot ever runs out
of data before the others (which would hang distributed training): a slot that finishes its
share of epoch e goes on with its share of epoch e + 1.

Within a shard, samples are read in order; the sentences of each sample are cut into
token-budget batches (``batching``) and shuffled, all from seeds derived from the run seed,
the language, the epoch, the shard and the sample. Each batch is one language, picked per
step by temperature sampling over the languages' sentence counts.

Resume. A slot's whole position is a few integers per language (shard position, sample,
batch) plus its step count, because every random choice is a pure function of the seed and
of that position. The slots' batches form one global order, which the ranks share out
(:mod:`megasemface.data.loading.loader_position`): the run's position is one counter plus the slots'
positions, whatever the number of ranks. Each batch travels with its slot's position after
it, so ``ShardLoader.state_dict()`` is exact even though DataLoader workers prefetch ahead,
and a loader restored from it yields exactly the batches the original would have yielded
next; restored from the states of all ranks, on another number of ranks or workers, the
ranks together read every global batch exactly once.

Bad data. An unreadable sample or shard (truncated tar, bad .npy, wrong counts, ids outside
the vocabulary) is skipped, counted and logged; above ``max_bad_fraction`` of samples the
loader stops with a DataError that names the shard. Only ``.npy`` (without pickle) and JSON
members are ever decoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from megasemface.data.loading.batching import Pool, token_budget_batches
from megasemface.data.loading.loader_position import (
    STATE_VERSION,
    merge_loader_states,
    rank_slots,
    slot_order,
)
from megasemface.data.shards.shard_format import Chunk, Manifest, ShardFormatError, decode_sample
from megasemface.data.text.languages import sampling_probs

__all__ = ["DataError", "LoaderConfig", "ShardLoader", "ShardSource", "TokenBatch", "batch_probs"]

logger = logging.getLogger(__name__)


class DataError(RuntimeError):
    """The training data cannot be read well enough to go on."""


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """How shards become batches."""

    max_tokens: int
    """Token budget of a batch, padding included (sentences x longest sentence)."""
    max_sentences: int = 0
    """Optional cap on sentences per batch (0: none)."""
    max_len: int = 256
    """Sentences are cropped to this many tokens. Pairs are never cropped: a source with
    language pairs needs at least their longest length (``PairLayout.max_length``)."""
    pool_tokens: int = 1 << 20
    """Consecutive shard samples are pooled up to this many tokens before length-grouped
    batching; a pool 100x the batch budget keeps padding under a few percent. Memory per
    reading slot: about 10 bytes per pooled token."""
    temperature: float = 1.0 / 0.7
    """Language sampling temperature: p_l ~ n_l ** (1 / T); XLM's alpha 0.7 by default."""
    pair_share: float | None = None
    """Share of batches drawn from language pairs when the source holds pairs and single
    languages, each kind divided among its own by temperature (None: one temperature over
    all, a pair counting its pairs); see :func:`~megasemface.data.text.languages.sampling_probs`."""
    languages: tuple[str, ...] = ()
    """Languages to read (empty: every language of the source)."""
    seed: int = 0
    """Decides shard order, batch composition and language choice."""
    shuffle: bool = True
    """Shuffle shard order each epoch (sentences are always grouped by length)."""
    num_workers: int | None = None
    """DataLoader worker processes per rank (0 or None: read in the training process;
    train.py's ``--num-workers`` picks one by device first, ``units/base.py``)."""
    prefetch_factor: int = 4
    """Batches each worker prepares ahead."""
    max_bad_fraction: float = 0.001
    """Stop with a DataError when more than this fraction of samples is unreadable..."""
    bad_sample_grace: int = 8
    """...and more than this many samples were (so one bad sample early on is not fatal)."""

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.max_tokens < self.max_len:
            raise ValueError(
                f"need 1 <= max_len <= max_tokens, got max_len={self.max_len}, "
                f"max_tokens={self.max_tokens}"
            )
        if self.pool_tokens < self.max_tokens:
            raise ValueError(f"pool_tokens ({self.pool_tokens}) must be >= max_tokens")
        if self.num_workers is None:
            self.num_workers = 0
        if self.num_workers < 0 or self.prefetch_factor < 1:
            raise ValueError("num_workers must be >= 0 and prefetch_factor >= 1")
        if self.pair_share is not None and not 0 < self.pair_share < 1:
            raise ValueError(f"pair_share must be in (0, 1), got {self.pair_share}")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        self.languages = tuple(self.languages)

    def order_fields(self) -> dict[str, Any]:
        """The options that decide which batches come out, in which order."""
        fields = dataclasses.asdict(self)
        for name in ("num_workers", "prefetch_factor", "max_bad_fraction", "bad_sample_grace"):
            del fields[name]
        if self.pair_share is None:
            del fields["pair_share"]  # as before the option: the fingerprints of runs stay
        return fields


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """Shards per language, and the language sizes used for temperature sampling."""

    shards: dict[str, list[str]]
    sizes: dict[str, int]
    vocab_size: int | None = None
    pair_lengths: dict[str, int] = dataclasses.field(default_factory=dict)
    """For language pairs (``en-de``), the longest pair their shards may hold; cropping a
    pair would cut off its target, so the loader refuses a shorter ``max_len``."""

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> ShardSource:
        langs = sorted(manifest.languages)
        return cls(
            shards={lang: manifest.shard_paths(lang) for lang in langs},
            sizes={lang: manifest.sentences(lang) for lang in langs},
            vocab_size=manifest.vocab_size,
            pair_lengths={
                name: layout.max_length for name, layout in manifest.pair_layouts.items()
            },
        )

    @classmethod
    def from_patterns(cls, patterns: dict[str, str], vocab_size: int | None = None) -> ShardSource:
        """Shards from brace patterns per language, e.g. ``{"de": "de-{000000..000099}.tar"}``.

        Without a manifest the sentence counts are unknown, so languages are weighted by their
        shard counts.
        """
        shards = {lang: list(wds.shardlists.expand_urls(p)) for lang, p in sorted(patterns.items())}
        return cls(
            shards=shards, sizes={k: len(v) for k, v in shards.items()}, vocab_size=vocab_size
        )

    def select(self, languages: tuple[str, ...]) -> ShardSource:
        if not languages:
            return self
        unknown = sorted(set(languages) - set(self.shards))
        if unknown:
            raise ValueError(
                f"languages {unknown} have no shards; available: {sorted(self.shards)}"
            )
        return ShardSource(
            {k: self.shards[k] for k in languages},
            {k: self.sizes[k] for k in languages},
            self.vocab_size,
            {k: v for k, v in self.pair_lengths.items() if k in languages},
        )


def batch_probs(source: ShardSource, config: LoaderConfig) -> dict[str, float]:
    """The probability that a batch is of each language or pair of ``source``."""
    return sampling_probs(source.sizes, config.temperature, source.pair_lengths, config.pair_share)


@dataclasses.dataclass
class TokenBatch:
    """A batch of sentences of one language, padded to the longest."""

    lang: str
    tokens: torch.Tensor
    """[B, T] int64 token ids, padded with the pad id."""
    lengths: torch.Tensor
    """[B] int64 real lengths."""
    sentence_ids: torch.Tensor
    """[B] int64 ids unique across the corpus: language, shard and sentence in the shard."""
    epochs: torch.Tensor
    """[B] int64: the epoch of the language's shard sequence each sentence was read in."""
    slot: int
    """The reading slot that produced it (at the run's start: rank x workers + worker)."""

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def epoch(self) -> int:
        """The latest epoch among the batch's sentences."""
        return int(self.epochs.max())

    def pin_memory(self) -> TokenBatch:
        return dataclasses.replace(
            self,
            tokens=self.tokens.pin_memory(),
            lengths=self.lengths.pin_memory(),
            sentence_ids=self.sentence_ids.pin_memory(),
            epochs=self.epochs.pin_memory(),
        )


def _lang_key(lang: str) -> int:
    return zlib.crc32(lang.encode("utf-8"))


class _SlotStream:
    """The endless, resumable batch stream of one slot."""

    def __init__(
        self,
        source: ShardSource,
        config: LoaderConfig,
        pad_id: int,
        slot: int,
        num_slots: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self.pad_id = pad_id
        self.slot = slot
        self.num_slots = num_slots
        self.langs = sorted(source.shards)
        for lang in self.langs:
            if not source.shards[lang]:
                raise DataError(f"language {lang!r} has no shards")
        probs = batch_probs(source, config)
        self.probs = np.array([probs[lang] for lang in self.langs])
        state = state or {}
        self.step: int = state.get("step", 0)
        self.cursors: dict[str, list[int]] = {
            lang: list(state.get("cursors", {}).get(lang, [0, 0, 0])) for lang in self.langs
        }
        self.counters: dict[str, int] = dict(
            state.get("counters", {"good": 0, "bad": 0, "sentences": 0, "tokens": 0, "padded": 0})
        )
        self._reader: dict[str, tuple[int, int, Iterator[dict[str, Any]]]] = {}
        self._pool: dict[str, Pool] = {}
        self._read_error: list[BaseException] = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursors": {lang: list(c) for lang, c in self.cursors.items()},
            "counters": dict(self.counters),
        }

    # Shard sequence ---------------------------------------------------------------------

    def shard_at(self, lang: str, k: int) -> tuple[int, int]:
        """(epoch, shard index) of this slot's k-th shard of a language."""
        num = len(self.source.shards[lang])
        epoch, rest = divmod(self.slot + k * self.num_slots, num)
        if not self.config.shuffle:
            return epoch, rest
        perm = np.random.default_rng([self.config.seed, _lang_key(lang), epoch]).permutation(num)
        return epoch, int(perm[rest])

    def _handler(self, exn: BaseException) -> bool:
        self._read_error.append(exn)
        return True  # skip what cannot be read, the loader counts it

    def _raw_sample(self, lang: str, k: int, sample: int) -> dict[str, Any] | None:
        """The sample-th raw sample of the k-th shard, or None past the shard's end."""
        cached = self._reader.get(lang)
        if cached is None or cached[0] != k or cached[1] != sample:
            _, index = self.shard_at(lang, k)
            url = self.source.shards[lang][index]
            self._read_error.clear()
            pipeline = wds.DataPipeline(
                wds.SimpleShardList([url]), wds.tarfile_to_samples(handler=self._handler)
            )
            iterator = iter(pipeline)
            for _ in range(sample):  # resume: skip without decoding
                if next(iterator, None) is None:
                    break
            cached = (k, sample, iterator)
        raw = next(cached[2], None)
        self._reader[lang] = (k, sample + 1, cached[2])
        if self._read_error:
            _, index = self.shard_at(lang, k)
            self._bad(self.source.shards[lang][index], self._read_error[0])
            self._read_error.clear()
        return raw

    def _bad(self, url: str, error: BaseException) -> None:
        self.counters["bad"] += 1
        bad, total = self.counters["bad"], self.counters["bad"] + self.counters["good"]
        logger.warning("skipping unreadable data in %s: %s", url, error)
        if bad > self.config.bad_sample_grace and bad > self.config.max_bad_fraction * total:
            raise DataError(
                f"{url}: unreadable data ({error}); {bad} of {total} samples read so far were "
                f"bad, above max_bad_fraction={self.config.max_bad_fraction}. Check the shard "
                "(tar tf, sha256 against manifest.json) or rebuild it with tools/build_shards.py"
            )

    def _read_pool(self, lang: str, k: int, sample: int) -> Pool:
        """The pool that starts at ``sample`` of this slot's k-th shard of a language.

        A pool reads on across shard ends until it holds ``pool_tokens`` tokens, so that
        length grouping works as well with small shards as with large ones.
        """
        cached = self._pool.get(lang)
        if cached is not None and cached.key == (k, sample):
            return cached
        chunks: list[tuple[Chunk, int, int]] = []
        pooled = 0
        position = (k, sample)
        empty_shards = 0  # consecutive shards without a readable sample
        shard_good = False
        while pooled < self.config.pool_tokens:
            raw = self._raw_sample(lang, *position)
            if raw is None:  # end of this shard: go on with the slot's next one
                empty_shards = 0 if shard_good else empty_shards + 1
                if empty_shards > len(self.source.shards[lang]):
                    raise DataError(f"no readable sample in any shard of language {lang!r}")
                position, shard_good = (position[0] + 1, 0), False
                continue
            epoch, index = self.shard_at(lang, position[0])
            position = (position[0], position[1] + 1)
            try:
                chunk = decode_sample(raw, self.source.vocab_size)
                if chunk.lang != lang:
                    raise ShardFormatError(
                        f"sample {raw.get('__key__')} is {chunk.lang!r}, not {lang!r}"
                    )
            except ShardFormatError as exc:
                self._bad(self.source.shards[lang][index], exc)
                continue
            self.counters["good"] += 1
            shard_good = True
            chunks.append((chunk, epoch, index))
            pooled += len(chunk.tokens)
        pool = Pool.merge(
            (k, sample), position, chunks, self.langs.index(lang), self.config.max_len
        )
        epoch, index = self.shard_at(lang, k)
        rng = np.random.default_rng([self.config.seed, _lang_key(lang), epoch, index, sample])
        pool.batches = token_budget_batches(
            pool.lengths, self.config.max_tokens, rng, self.config.max_sentences
        )
        self._pool[lang] = pool
        return pool

    # Batches ----------------------------------------------------------------------------

    def _pick_language(self) -> str:
        if len(self.langs) == 1:
            return self.langs[0]
        rng = np.random.default_rng([self.config.seed, 7919, self.slot, self.step])
        return self.langs[int(rng.choice(len(self.langs), p=self.probs))]

    def _next_batch_of(self, lang: str) -> TokenBatch:
        cursor = self.cursors[lang]
        while True:
            k, sample, batch = cursor
            pool = self._read_pool(lang, k, sample)
            if batch >= len(pool.batches):
                cursor[:] = [*pool.next_key, 0]
                continue
            cursor[2] = batch + 1
            return self._make_batch(lang, pool, pool.batches[batch])

    def _make_batch(self, lang: str, pool: Pool, rows: np.ndarray) -> TokenBatch:
        lengths = pool.lengths[rows]
        tokens = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
        for row, (start, length) in enumerate(zip(pool.offsets[rows], lengths, strict=True)):
            tokens[row, :length] = pool.tokens[start : start + length]
        self.counters["sentences"] += len(rows)
        self.counters["tokens"] += int(lengths.sum())
        self.counters["padded"] += tokens.size
        return TokenBatch(
            lang=lang,
            tokens=torch.from_numpy(tokens),
            lengths=torch.from_numpy(lengths.astype(np.int64)),
            sentence_ids=torch.from_numpy(pool.sentence_ids[rows]),
            epochs=torch.from_numpy(pool.epochs[rows]),
            slot=self.slot,
        )

    def next_batch(self) -> TokenBatch:
        batch = self._next_batch_of(self._pick_language())
        self.step += 1
        return batch


class _Reader(IterableDataset):
    """Reads the global batches ``start, start + stride, ...``, each from its slot's stream;
    yields (batch, the slot's state after it).

    With the run's starting numbers of ranks and workers a reader reads one slot and all of
    it; otherwise it may read several slots, and a slot that several readers share is read
    by each, which skip the batches that are not theirs. As a DataLoader dataset, worker
    ``i`` of ``W`` takes the rank's batches ``i, i + W, ...``: DataLoader's round robin.
    """

    def __init__(self, loader: ShardLoader, start: int, stride: int, workers: int = 1) -> None:
        self.source = loader.source
        self.config = loader.config
        self.pad_id = loader.pad_id
        self.order = list(loader.order)
        self.states = {slot: dict(s) for slot, s in loader._states.items()}
        self.start = start
        self.stride = stride
        self.workers = workers

    def __iter__(self) -> Iterator[tuple[TokenBatch, dict[str, Any]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        streams: dict[int, _SlotStream] = {}
        count = len(self.order)
        position = self.start + worker * self.stride
        while True:
            slot, index = self.order[position % count], position // count
            stream = streams.get(slot)
            if stream is None:
                stream = streams[slot] = _SlotStream(
                    self.source,
                    self.config,
                    self.pad_id,
                    slot=slot,
                    num_slots=count,
                    state=self.states.get(slot),
                )
            if stream.step > index:
                raise ValueError(
                    f"loader state is inconsistent: slot {slot} is past its batch {index}"
                )
            while stream.step < index:  # another reader's batch
                stream.next_batch()
            batch = stream.next_batch()
            yield batch, stream.state_dict()
            position += self.stride * self.workers


class ShardLoader:
    """An endless stream of TokenBatch for one data-parallel rank, with exact resume.

    Iterating again continues where the last iteration stopped; ``state_dict()`` captures
    the position after the last batch handed out and ``load_state_dict()`` restores it.
    The data-parallel rank and size are passed explicitly (model-parallel peers of a rank
    pass the same data-parallel rank and read the same batches).
    """

    def __init__(
        self,
        source: ShardSource,
        config: LoaderConfig,
        *,
        pad_id: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.source = source.select(config.languages)
        cropped = {k: v for k, v in self.source.pair_lengths.items() if v > config.max_len}
        if cropped:
            raise ValueError(
                f"language pairs {sorted(cropped)} hold pairs of up to {max(cropped.values())} "
                f"tokens (source, separator, target), and max_len={config.max_len} would cut "
                "off their targets: set LoaderConfig.max_len (and max_tokens) to at least "
                "that, or read only other languages (LoaderConfig.languages)"
            )
        self.config = config
        self.pad_id = pad_id
        self.rank = rank
        self.world_size = world_size
        self.workers = max(1, config.num_workers)
        self.order = slot_order(world_size, self.workers)
        self.position = 0
        """Global batches the ranks have handed out together; this rank's next one is
        ``position + rank``."""
        self._states: dict[int, dict[str, Any]] = {}
        few = [lang for lang, urls in self.source.shards.items() if len(urls) < self.num_slots]
        if few and rank == 0:
            logger.info(
                "languages %s have fewer shards than the %d reading slots; slots share epochs "
                "of them in turn (still each shard once per epoch)",
                few,
                self.num_slots,
            )

    @property
    def fingerprint(self) -> str:
        described = {"shards": self.source.shards, "sizes": self.source.sizes}
        described["config"] = self.config.order_fields()
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def num_slots(self) -> int:
        return len(self.order)

    def sampling(self) -> dict[str, Any]:
        """How batches are drawn between languages (or pairs): the temperature, and per
        language its sentence count and the probability a batch is of that language."""
        probs = batch_probs(self.source, self.config)
        return {
            "temperature": self.config.temperature,
            "pair_share": self.config.pair_share,
            "languages": {
                lang: {"sentences": self.source.sizes[lang], "probability": probs[lang]}
                for lang in sorted(self.source.sizes)
            },
        }

    def __iter__(self) -> Iterator[TokenBatch]:
        # On a GPU machine each batch is handed over in page-locked memory: a copy to the
        # device from pageable memory waits for the device to reach it in its stream (the
        # steps queued before it), which would stall the host once a step; from pinned
        # memory the step's non-blocking copy is queued and the host goes on.
        pinned = torch.cuda.is_available()
        for batch in self._batches():
            yield batch.pin_memory() if pinned else batch

    def _batches(self) -> Iterator[TokenBatch]:
        start = self.position + self.rank
        if self.config.num_workers == 0:
            for batch, state in _Reader(self, start, self.world_size):
                self._taken(batch.slot, state)
                yield batch
            return
        loader = DataLoader(
            _Reader(self, start, self.world_size, self.workers),
            batch_size=None,
            num_workers=self.config.num_workers,
            prefetch_factor=self.config.prefetch_factor,
            persistent_workers=False,
        )
        for batch, state in loader:
            self._taken(batch.slot, state)
            yield batch

    def _taken(self, slot: int, state: dict[str, Any]) -> None:
        """Records a batch handed out: its slot's state after it, and the position."""
        known = self._states.get(slot)
        if known is None or state["step"] > known["step"]:
            self._states[slot] = state
        self.position += self.world_size

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: plain ints and strings, safe for ``weights_only`` loading."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "rank": self.rank,
            "world_size": self.world_size,
            "workers": self.workers,
            "order": list(self.order),
            "position": self.position,
            "slots": {str(slot): s for slot, s in sorted(self._states.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores this rank's own state; after a change in the number of ranks, pass every
        rank's to :meth:`load_states` (a rank's own lacks the slots it never read)."""
        self.load_states([state])

    def load_states(self, states: list[dict[str, Any]]) -> None:
        """Continues from the states of a run's ranks, whatever their number and this one's
        (:mod:`~megasemface.data.loading.loader_position`): pass all of them when the number of
        ranks changed; the ranks then read every global batch exactly once."""
        merged = merge_loader_states(states, self.fingerprint)
        self.order = merged["order"]
        self.position = merged["position"]
        mine = rank_slots(self.order, self.position, self.rank, self.world_size)
        self._states = {slot: s for slot, s in merged["slots"].items() if slot in mine}

    def stats(self) -> dict[str, int]:
        """Totals over this rank's slots: samples read and unreadable, sentences, tokens."""
        totals = {"good": 0, "bad": 0, "sentences": 0, "tokens": 0, "padded": 0}
        for state in self._states.values():
            for key in totals:
                totals[key] += state.get("counters", {}).get(key, 0)
        return totals
