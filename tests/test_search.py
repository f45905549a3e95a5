"""Greedy and beam search: on a random tiny Seq2SeqModel, and on hand-built probability tables
where the right answer is known."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from megasemface.distributed.engine import on_device
from megasemface.inference.search import (
    Hypothesis,
    SearchConfig,
    beam_search,
    greedy_search,
    max_lengths,
    min_lengths,
    search,
)
from megasemface.nn.config import build_model_config
from megasemface.nn.transformer import DecoderCache, EncoderOutput, Seq2SeqModel
from megasemface.training.units.translation import _EngineScorer

EOS, PAD, TAG = 2, 3, 5
BANNED = (0, 1, 3, 4, 5)  # unk, bos, pad, mask, the tag: generation picks among 2, 6, 7...
MAX_POSITIONS = 32


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # These matrices are tiny: a second intra-op thread gains nothing and spin-waits for
    # seconds when the suite's two cores are busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> Seq2SeqModel:
    """A random tiny model whose </s> is likely enough that sentences end at varied lengths."""
    torch.manual_seed(0)
    config = build_model_config("tiny", ["vocab_size=64", f"max_len={MAX_POSITIONS}"])
    model = Seq2SeqModel(config).eval()
    with torch.no_grad():
        model.decoder.output_bias[EOS] = 2.5
    return model


def make_batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Random sources ``x </s>`` of the given lengths (</s> included), padded."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths, default=1)
    src = torch.randint(6, 64, (len(lengths), longest), generator=g)
    lengths_B = torch.tensor(lengths, dtype=torch.long)
    mask = torch.arange(longest)[None, :] < lengths_B[:, None]
    src[torch.arange(len(lengths)), lengths_B - 1] = EOS
    src[~mask] = PAD
    return src, mask, torch.zeros(len(lengths), dtype=torch.long)


def run(scorer: object, batch: tuple[torch.Tensor, ...], config: SearchConfig, **kw: object):
    fn = kw.pop("fn", search)
    return fn(  # type: ignore[operator]
        scorer,
        *batch,
        tgt_tags=TAG,
        tgt_langs=1,
        max_positions=MAX_POSITIONS,
        config=config,
        eos_id=EOS,
        banned_ids=BANNED,
        **kw,
    )


class Counting:
    """A real scorer that counts its calls (and may wait at a barrier, as a collective)."""

    def __init__(self, inner: object, collective: threading.Barrier | None = None) -> None:
        self.inner = inner
        self.collective = collective
        self.encodes = 0
        self.steps = 0
        self.rows: list[int] = []

    def encode(self, src: torch.Tensor, mask: torch.Tensor, langs: torch.Tensor) -> EncoderOutput:
        self.encodes += 1
        self._collective()
        return self.inner.encode(src, mask, langs)  # type: ignore[attr-defined]

    def decode_step(
        self,
        prefix: torch.Tensor,
        langs: torch.Tensor,
        memory: EncoderOutput,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        self.steps += 1
        self.rows.append(prefix.shape[0])
        self._collective()
        return self.inner.decode_step(prefix, langs, memory, cache)  # type: ignore[attr-defined]

    def _collective(self) -> None:
        if self.collective is not None:
            self.collective.wait(timeout=60)  # a mismatch breaks the barrier instead of hanging


class Table:
    """A scorer with fixed next-token probabilities per generated prefix (tokens after the tag)."""

    VOCAB = 8
    A, B = 6, 7

    def __init__(
        self,
        table: dict[tuple[int, ...], dict[int, float]],
        default: dict[int, float] | None = None,
    ) -> None:
        self.table = table
        self.default = default or {EOS: 1.0}

    def encode(self, src: torch.Tensor, mask: torch.Tensor, langs: torch.Tensor) -> EncoderOutput:
        hidden = torch.zeros(src.shape[0], src.shape[1], 1)
        return EncoderOutput(hidden, hidden, mask)

    def decode_step(
        self,
        prefix: torch.Tensor,
        langs: torch.Tensor,
        memory: EncoderOutput,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        rows = []
        for generated in prefix[:, 1:].tolist():
            probs = torch.zeros(self.VOCAB, dtype=torch.float64)
            for token, p in self.table.get(tuple(generated), self.default).items():
                probs[token] = p
            rows.append(probs.log().float())
        return torch.stack(rows)


def search_select(memory: EncoderOutput, rows: torch.Tensor | list[int]) -> EncoderOutput:
    index = torch.as_tensor(rows, dtype=torch.long)
    return EncoderOutput(*(t.index_select(0, index) for t in dataclasses.astuple(memory)))


def one_sentence() -> tuple[torch.Tensor, ...]:
    return make_batch([3])


def test_beam_one_is_greedy(model: Seq2SeqModel) -> None:
    batch = make_batch([9, 3, 5, 1, 7, 2, 12, 4])
    for lenpen in (1.0, 0.0):
        greedy = run(model, batch, SearchConfig(lenpen=lenpen), fn=greedy_search)
        beam = run(model, batch, SearchConfig(beam=1, lenpen=lenpen), fn=beam_search)
        assert [h.tokens for h in beam] == [h.tokens for h in greedy]
        assert [h.score for h in beam] == pytest.approx([h.score for h in greedy], abs=1e-6)
        lengths = {len(h.tokens) for h in greedy}
        assert len(lengths) > 2  # sentences ended at different steps: compaction was exercised
        for h in greedy:
            assert h.score == pytest.approx(h.log_prob / (len(h.tokens) + 1) ** lenpen)
            assert EOS not in h.tokens and not set(BANNED) & set(h.tokens)


def test_beam_search_scores_are_its_tokens_log_probs(model: Seq2SeqModel) -> None:
    """Re-scoring each beam output token by token, one sentence alone, gives the reported
    log-probability: the batched bookkeeping (reordering, compaction) kept rows apart."""
    src, mask, langs = make_batch([6, 2, 8, 4])
    beam = run(model, (src, mask, langs), SearchConfig(beam=4, lenpen=1.0))
    with torch.no_grad():
        for i, hyp in enumerate(beam):
            length = int(mask[i].sum())
            memory = model.encode(src[i : i + 1, :length], mask[i : i + 1, :length], langs[:1])
            tokens = [TAG, *hyp.tokens, EOS]
            total = 0.0
            for t in range(1, len(tokens)):
                logp = model.decode_step(torch.tensor([tokens[:t]]), torch.tensor([1]), memory)
                total += float(logp[0, tokens[t]])
            assert hyp.log_prob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_incremental_decoding_equals_recomputing_every_prefix(
    model: Seq2SeqModel, beam: int
) -> None:
    """The key/value cache follows the rows through beam reordering and compaction."""
    batch = make_batch([9, 3, 5, 1, 7, 2, 12, 4], seed=3)
    for lenpen in (1.0, 0.0):
        config = SearchConfig(beam=beam, lenpen=lenpen, max_len_a=1.5, max_len_b=3)
        cached = run(model, batch, config)
        full = run(model, batch, dataclasses.replace(config, incremental=False))
        assert [h.tokens for h in cached] == [h.tokens for h in full]
        assert [h.log_prob for h in cached] == pytest.approx([h.log_prob for h in full], abs=1e-5)
        assert len({len(h.tokens) for h in cached}) > 2


def test_decoder_cache_steps_equal_full_prefixes(model: Seq2SeqModel) -> None:
    src, mask, langs = make_batch([6, 4, 9], seed=4)
    tokens = torch.randint(6, 64, (3, 7), generator=torch.Generator().manual_seed(5))
    tokens[:, 0] = TAG
    tgt_langs = torch.ones(3, dtype=torch.long)
    with torch.no_grad():
        memory = model.encode(src, mask, langs)
        cache = DecoderCache()
        first = model.decode_step(tokens[:, :3], tgt_langs, memory, cache)  # several at once
        torch.testing.assert_close(first, model.decode_step(tokens[:, :3], tgt_langs, memory))
        order = torch.tensor([2, 0, 0])  # reorder and duplicate rows, as beam search does
        cache, memory, tokens = cache.select(order), search_select(memory, order), tokens[order]
        for t in range(4, 8):
            step = model.decode_step(tokens[:, :t], tgt_langs, memory, cache)
            torch.testing.assert_close(step, model.decode_step(tokens[:, :t], tgt_langs, memory))
        assert cache.length == 7
        with pytest.raises(ValueError, match="already in the cache"):
            model.decode_step(tokens, tgt_langs, memory, cache)


def test_cached_and_uncached_steps_call_the_same_modules(model: Seq2SeqModel) -> None:
    """ZeRO-3 gathers a module's weights when it is called, collectively: a rank decoding
    from its cache and a rank running an uncached dummy step (lockstep) must call the same
    modules in the same order."""
    calls: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda m, _, name=name: calls.append(name))
        for name, module in model.decoder.named_modules()
    ]
    src, mask, langs = make_batch([5, 3])
    prefix = torch.tensor([[TAG, 7, 8], [TAG, 9, 10]])
    tgt_langs = torch.ones(2, dtype=torch.long)
    try:
        with torch.no_grad():
            memory = model.encode(src, mask, langs)
            cache = DecoderCache()
            sequences = []
            for t in (1, 2, 3):
                calls.clear()
                model.decode_step(prefix[:, :t], tgt_langs, memory, cache)
                sequences.append(list(calls))
            calls.clear()
            model.decode_step(prefix[:1, :1], tgt_langs[:1], search_select(memory, [0]))
            sequences.append(list(calls))
    finally:
        for handle in handles:
            handle.remove()
    assert "layers.0.cross_attn.kv_proj" in sequences[0]
    assert all(seq == sequences[0] for seq in sequences)


def test_beam_finds_what_greedy_misses() -> None:
    # Greedy takes A (0.6) and then ends at 0.6 * 0.3; B then </s> has 0.4 * 0.9.
    table = Table(
        {
            (): {Table.A: 0.6, Table.B: 0.4},
            (Table.A,): {EOS: 0.3, Table.A: 0.35, Table.B: 0.35},
            (Table.B,): {EOS: 0.9, Table.A: 0.1},
        }
    )
    config = SearchConfig(lenpen=0.0, max_len_a=0, max_len_b=2)
    greedy = run(table, one_sentence(), config)[0]
    beam = run(table, one_sentence(), SearchConfig(beam=2, lenpen=0.0, max_len_a=0, max_len_b=2))
    assert greedy.tokens[0] == Table.A and greedy.log_prob < math.log(0.4 * 0.9)
    assert beam[0].tokens == [Table.B]
    assert beam[0].log_prob == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)


def test_length_penalty_changes_the_choice() -> None:
    # Ending at once: 0.45. "A A </s>": 0.55 * 0.8 * 0.8 = 0.352 in all, but 0.70 a token.
    table = Table(
        {
            (): {EOS: 0.45, Table.A: 0.55},
            (Table.A,): {Table.A: 0.8, EOS: 0.1, Table.B: 0.1},
            (Table.A, Table.A): {EOS: 0.8, Table.B: 0.2},
        }
    )
    chosen = {}
    for lenpen in (0.0, 1.0):
        config = SearchConfig(beam=2, lenpen=lenpen, max_len_a=0, max_len_b=4)
        chosen[lenpen] = run(table, one_sentence(), config)[0]
    assert chosen[0.0].tokens == []
    assert chosen[0.0].score == pytest.approx(math.log(0.45), abs=1e-6)
    assert chosen[1.0].tokens == [Table.A, Table.A]
    assert chosen[1.0].score == pytest.approx(math.log(0.55 * 0.8 * 0.8) / 3, abs=1e-6)


def test_exact_stop_keeps_searching_where_a_longer_output_can_still_win() -> None:
    # </s> first (0.6) beats A (0.4) at length 1, but "A A A </s>" (the last </s> is forced,
    # with probability 1 here) averages more per token.
    table = Table(
        {
            (): {EOS: 0.6, Table.A: 0.4},
            (Table.A,): {Table.A: 0.99, EOS: 0.01},
            (Table.A, Table.A): {Table.A: 0.99, EOS: 0.01},
        }
    )
    config = SearchConfig(beam=1, lenpen=1.0, max_len_a=0, max_len_b=3)
    assert run(table, one_sentence(), config)[0].tokens == []
    exact = run(table, one_sentence(), dataclasses.replace(config, exact_stop=True))[0]
    assert exact.tokens == [Table.A] * 3
    assert exact.score == pytest.approx(math.log(0.4 * 0.99**2) / 4, abs=1e-6)


@pytest.mark.parametrize("beam", [1, 3])
def test_length_limits(model: Seq2SeqModel, beam: int) -> None:
    batch = make_batch([9, 3, 5, 1, 7])
    short = run(model, batch, SearchConfig(beam=beam, max_len_a=0, max_len_b=2))
    assert max(len(h.tokens) for h in short) == 2
    # The per-sentence limit: a * source length (with its </s>) + b.
    scaled = run(model, batch, SearchConfig(beam=beam, max_len_a=1.0, max_len_b=0))
    assert all(len(h.tokens) <= n for h, n in zip(scaled, [9, 3, 5, 1, 7], strict=True))
    bounded = run(model, batch, SearchConfig(beam=beam, min_len=4, max_len_a=0, max_len_b=6))
    assert all(4 <= len(h.tokens) <= 6 for h in bounded)
    fixed = run(model, batch, SearchConfig(beam=beam, min_len=5, max_len_a=0, max_len_b=5))
    assert [len(h.tokens) for h in fixed] == [5] * 5
    # The position embeddings cap everything: the prefix (tag + tokens) fits MAX_POSITIONS.
    capped = run(model, batch, SearchConfig(beam=beam, min_len=100, max_len_a=0, max_len_b=100))
    assert [len(h.tokens) for h in capped] == [MAX_POSITIONS - 1] * 5
    limits = max_lengths(torch.tensor([1, 10, 30]), SearchConfig(max_len_a=1.5, max_len_b=2), 20)
    assert limits.tolist() == [3, 17, 19]


@pytest.mark.parametrize("beam", [1, 3])
def test_minimum_length_relative_to_the_source(beam: int) -> None:
    lengths = [9, 3, 5, 1, 7]  # with </s>
    batch = make_batch(lengths)
    ends_at_once = Table({}, default={EOS: 0.9, Table.A: 0.1})
    free = run(ends_at_once, batch, SearchConfig(beam=beam))
    assert [len(h.tokens) for h in free] == [0] * 5
    # int(a * source length + b) tokens at least, per sentence
    config = SearchConfig(beam=beam, min_len_a=0.5, min_len=1)
    held = run(ends_at_once, batch, config)
    assert [len(h.tokens) for h in held] == [5, 2, 3, 1, 4]
    assert min_lengths(torch.tensor(lengths), config).tolist() == [5, 2, 3, 1, 4]
    # the maximum still ends a sentence first
    capped = SearchConfig(beam=beam, min_len_a=2.0, max_len_a=1.0, max_len_b=0)
    assert [len(h.tokens) for h in run(ends_at_once, batch, capped)] == lengths


@pytest.mark.parametrize("beam", [1, 3])
def test_lockstep_extra_steps_change_nothing(model: Seq2SeqModel, beam: int) -> None:
    batch = make_batch([5, 2, 8])
    config = SearchConfig(beam=beam, max_len_a=0, max_len_b=8)
    plain = Counting(model)
    expected = run(plain, batch, config)
    extra = 4
    asked: list[bool] = []

    def keep_going(local_unfinished: bool) -> bool:
        asked.append(local_unfinished)
        return local_unfinished or asked.count(False) <= extra

    lockstep = Counting(model)
    assert run(lockstep, batch, config, keep_going=keep_going) == expected
    assert lockstep.encodes == 1
    assert lockstep.steps == plain.steps + extra == len(asked) - 1
    assert lockstep.rows[-extra:] == [1] * extra  # the cheap dummy row


def test_empty_batch(model: Seq2SeqModel) -> None:
    empty = make_batch([])
    idle = Counting(model)
    assert run(idle, empty, SearchConfig(beam=2)) == []
    assert (idle.encodes, idle.steps) == (0, 0)
    answers = iter([True, True, True, False])
    lockstep = Counting(model)
    assert run(lockstep, empty, SearchConfig(beam=2), keep_going=lambda _: next(answers)) == []
    assert (lockstep.encodes, lockstep.steps, lockstep.rows) == (1, 3, [1, 1, 1])


def run_ranks(
    model: Seq2SeqModel, batches: list[tuple[torch.Tensor, ...]], config: SearchConfig
) -> tuple[list[list[Hypothesis]], list[Counting]]:
    """Searches one batch per thread, the threads standing for ranks: ``keep_going`` is an
    all-reduce of the ranks' flags, and every encode/decode_step call waits at a barrier as
    ZeRO-3's parameter gathers do, so a rank that stopped calling early would break it."""
    ranks = len(batches)
    flags = [False] * ranks
    vote = threading.Barrier(ranks, timeout=60)
    collective = threading.Barrier(ranks, timeout=60)
    scorers = [Counting(model, collective) for _ in range(ranks)]
    results: list[list[Hypothesis]] = [[] for _ in range(ranks)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        def keep_going(local_unfinished: bool) -> bool:
            flags[r] = local_unfinished
            vote.wait()
            anyone = any(flags)
            vote.wait()  # nobody overwrites a flag before every rank has read them all
            return anyone

        try:
            results[r] = run(scorers[r], batches[r], config, keep_going=keep_going)
        except BaseException as exc:  # reported by the caller; the other ranks stop too
            errors.append(exc)
            collective.abort()
            vote.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results, scorers


@pytest.mark.parametrize("beam", [1, 2])
def test_two_ranks_in_lockstep(model: Seq2SeqModel, beam: int) -> None:
    long, short, empty = make_batch([12, 9, 14], seed=2), make_batch([2]), make_batch([])
    config = SearchConfig(beam=beam, max_len_a=1.0, max_len_b=2)
    for batches in ([long, short], [empty, long]):
        results, scorers = run_ranks(model, batches, config)
        assert results == [run(model, b, config) for b in batches]
        assert scorers[0].steps == scorers[1].steps > 0
        assert scorers[0].encodes == scorers[1].encodes == 1


def test_keep_going_must_count_this_rank(model: Seq2SeqModel) -> None:
    with pytest.raises(RuntimeError, match="ANY rank"):
        run(model, make_batch([3]), SearchConfig(), keep_going=lambda _: False)


def test_bad_inputs(model: Seq2SeqModel) -> None:
    src, mask, langs = make_batch([3, 2])
    with pytest.raises(ValueError, match="at least one real token"):
        run(model, (src, torch.zeros_like(mask), langs), SearchConfig())
    with pytest.raises(ValueError, match="src_langs_B"):
        run(model, (src, mask, langs[:1]), SearchConfig())
    with pytest.raises(ValueError, match="tgt_tags"):
        greedy_search(
            model, src, mask, langs, tgt_tags=torch.tensor([5]), tgt_langs=1, max_positions=32
        )
    with pytest.raises(ValueError, match="beam"):
        SearchConfig(beam=0)
    with pytest.raises(ValueError, match="min_len_a"):
        SearchConfig(min_len_a=-0.5)


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def test_repeated_ngram_blocking_equals_a_direct_scan() -> None:
    from megasemface.inference.search import _block_repeated_ngrams

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(6, 9, (40, 9), generator=g)  # 3 ids: repeats are frequent
    logp = torch.randn(40, 12, generator=g)
    for n in (1, 2, 3):
        blocked = _block_repeated_ngrams(logp, tokens, n)
        for row, generated in enumerate(tokens.tolist()):
            seen = set(_ngrams(generated, n))
            tail = tuple(generated[len(generated) - (n - 1) :])
            banned = {v for v in range(12) if (*tail, v) in seen}
            assert {v for v in range(12) if blocked[row, v] == -math.inf} == banned
            kept = [v for v in range(12) if v not in banned]
            assert torch.equal(blocked[row, kept], logp[row, kept])


@pytest.mark.parametrize("beam", [1, 4])
def test_no_repeat_ngram_stops_a_loop(model: Seq2SeqModel, beam: int) -> None:
    # A decoder that loops: A B A B ... is far likelier than anything, </s> never comes.
    loop = Table(
        {(Table.A, Table.B) * i: {Table.A: 0.9, Table.B: 0.05, EOS: 0.05} for i in range(9)}
    )
    loop.table.update(
        {
            (Table.A, Table.B) * i + (Table.A,): {Table.B: 0.9, Table.A: 0.05, EOS: 0.05}
            for i in range(9)
        }
    )
    config = SearchConfig(beam=beam, max_len_a=0, max_len_b=12)
    (free,) = run(loop, one_sentence(), config)
    assert len(set(_ngrams(free.tokens, 2))) < len(_ngrams(free.tokens, 2)) == 11
    (blocked,) = run(loop, one_sentence(), dataclasses.replace(config, no_repeat_ngram=2))
    assert len(set(_ngrams(blocked.tokens, 2))) == len(_ngrams(blocked.tokens, 2))
    if beam == 1:  # after A B A, B would repeat "A B": the likeliest left is </s>
        assert blocked.tokens == [Table.A, Table.B, Table.A]
    # On a real model: no bigram twice in any output.
    for hyp in run(model, make_batch([9, 3, 12, 7]), SearchConfig(beam=beam, no_repeat_ngram=2)):
        assert len(set(_ngrams(hyp.tokens, 2))) == len(_ngrams(hyp.tokens, 2))


class _ModelEngine:
    """The translation step's search through the training engine: each call's arguments pass
    through ``on_device`` as ``DeepSpeedEngine.run`` passes them, onto the model."""

    device = torch.device("cpu")
    """Where the model runs, as ``DeepSpeedEngine.device`` says (the search makes its
    tensors there)."""

    def __init__(self, model: Seq2SeqModel) -> None:
        self.model = model
        self.cached: list[int] = []
        """Positions already in the cache at each decoding step."""

    def run(self, task: Callable[..., object], *args: object) -> object:
        moved = [on_device(arg, self.device) for arg in args]
        if task == self.model.decode_step:
            self.cached.append(moved[3].length)  # type: ignore[attr-defined]
        return task(*moved)


def test_search_through_the_engine_keeps_its_cache(model: Seq2SeqModel) -> None:
    """The engine hands the decoding cache on as the same object, which the step fills in
    place: each step decodes only its new position, and the hypotheses match the model's."""
    batch = make_batch([5, 9, 3, 7])
    for config in (SearchConfig(), SearchConfig(beam=4)):
        engine = _ModelEngine(model)
        through = run(_EngineScorer(engine, model), batch, config)  # type: ignore[arg-type]
        assert [h.tokens for h in through] == [h.tokens for h in run(model, batch, config)]
        assert engine.cached[:4] == [0, 1, 2, 3]
