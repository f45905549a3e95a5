"""Tests of the batched noising functions: statistics, invariants, determinism, edge cases.

Statistical checks run on large random batches with fixed seeds, so they are deterministic;
their tolerances are several standard deviations wide so that a change of seed (or of the
order of random draws) would not make them fail by chance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from megasemface.objectives.noising import (
    IGNORE_INDEX,
    drop_and_shuffle,
    infill_spans,
    mask_for_mlm,
    pack_left,
    permute_sentences,
    random_ranks,
    real_token_mask,
    sentence_boundary_ids,
)

PAD, MASK, BOS, EOS = 0, 1, 2, 3
SPECIAL = (PAD, MASK, BOS, EOS)
FIRST_REAL = 10  # unique token ids start here, clear of the special ids
Noiser = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def position_batch(
    batch_size: int, width: int, min_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose token at position t is FIRST_REAL + t (unique within a row), pads after."""
    lengths = torch.randint(min_len, width + 1, (batch_size,), generator=gen(seed))
    tokens = (FIRST_REAL + torch.arange(width)).expand(batch_size, width).clone()
    tokens[~real_token_mask(lengths, width)] = PAD
    return tokens, lengths


def random_batch(
    batch_size: int, width: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random non-special tokens with random lengths in [0, width]."""
    g = gen(seed)
    lengths = torch.randint(0, width + 1, (batch_size,), generator=g)
    tokens = torch.randint(FIRST_REAL, vocab, (batch_size, width), generator=g)
    tokens[~real_token_mask(lengths, width)] = PAD
    return tokens, lengths


def assert_left_aligned(tokens: torch.Tensor, lengths: torch.Tensor) -> None:
    real = real_token_mask(lengths, tokens.size(1))
    assert bool((tokens[~real] == PAD).all()), "padding must follow the real tokens"
    assert bool((tokens[real] != PAD).all()), "no pad inside the real tokens"


def row(tokens: torch.Tensor, lengths: torch.Tensor, b: int) -> list[int]:
    return tokens[b, : int(lengths[b])].tolist()


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def test_pack_left_keeps_order_and_pads() -> None:
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    keep = torch.tensor(
        [[True, False, True, True], [False, False, False, False], [True, False, False, False]]
    )
    packed, lengths = pack_left(tokens, keep, pad_id=PAD)
    assert packed.tolist() == [[5, 7, 8], [0, 0, 0], [11, 0, 0]]
    assert lengths.tolist() == [3, 0, 1]
    packed, _ = pack_left(tokens, keep, pad_id=PAD, width=4)
    assert packed.shape == (3, 4)
    with pytest.raises(ValueError):
        pack_left(tokens, keep, pad_id=PAD, width=2)


def test_random_ranks_permute_valid_entries_first() -> None:
    valid = real_token_mask(torch.tensor([3, 0, 5]), 5)
    ranks = random_ranks(valid, gen(0))
    for b in range(3):
        assert sorted(ranks[b].tolist()) == list(range(5))
        n = int(valid[b].sum())
        assert sorted(ranks[b, :n].tolist()) == list(range(n))
        assert ranks[b, n:].tolist() == list(range(n, 5))  # invalid ones in position order


# ---------------------------------------------------------------------------------------
# mask_for_mlm
# ---------------------------------------------------------------------------------------

VOCAB = 5000


def run_mlm(tokens: torch.Tensor, lengths: torch.Tensor, seed: int = 0, **kwargs: float):
    return mask_for_mlm(
        tokens,
        lengths,
        mask_id=MASK,
        vocab_size=VOCAB,
        special_ids=SPECIAL,
        generator=gen(seed),
        **kwargs,
    )


def test_mlm_statistics() -> None:
    tokens, lengths = random_batch(512, 128, VOCAB, seed=1)
    inputs, targets = run_mlm(tokens, lengths)
    real = real_token_mask(lengths, tokens.size(1))
    chosen = targets != IGNORE_INDEX

    # Targets: the original id exactly at the chosen positions, never on pads.
    assert bool((targets[chosen] == tokens[chosen]).all())
    assert not bool((chosen & ~real).any())
    assert bool((inputs[~chosen] == tokens[~chosen]).all()), "unchosen positions untouched"
    # Exact count per row: round(0.15 n), at least one.
    expected = torch.where(lengths > 0, torch.round(lengths * 0.15).clamp(min=1), 0)
    assert chosen.sum(dim=1).tolist() == expected.long().tolist()
    assert abs(chosen.sum().item() / real.sum().item() - 0.15) < 0.005

    # 80/10/10 split of the ~4900 targets (standard deviations ~0.6% and ~0.4%).
    n = chosen.sum().item()
    masked = (inputs == MASK) & chosen
    kept = (inputs == tokens) & chosen
    replaced = chosen & ~masked & ~kept
    assert abs(masked.sum().item() / n - 0.8) < 0.025
    # A random replacement equals the original with probability ~1/5000: negligible.
    assert abs(kept.sum().item() / n - 0.1) < 0.02
    assert abs(replaced.sum().item() / n - 0.1) < 0.02
    # Random replacements are never special ids and cover the vocabulary.
    random_ids = inputs[replaced]
    assert not bool(torch.isin(random_ids, torch.tensor(SPECIAL)).any())
    assert int(random_ids.min()) >= 0 and int(random_ids.max()) < VOCAB
    assert random_ids.unique().numel() > 0.8 * random_ids.numel()
    # Pads are untouched.
    assert bool((inputs[~real] == PAD).all())


def test_mlm_random_replacement_avoids_specials() -> None:
    vocab = 12
    tokens, lengths = random_batch(256, 64, vocab, seed=2)
    inputs, _ = mask_for_mlm(
        tokens,
        lengths,
        mask_id=MASK,
        vocab_size=vocab,
        special_ids=[PAD, BOS, EOS, 9, 10, 11],  # mask_id is excluded even when not listed
        generator=gen(0),
        mask_frac=0.0,
        random_frac=1.0,
    )
    produced = inputs[real_token_mask(lengths, 64) & (inputs != tokens)]
    assert produced.numel() > 0
    assert set(produced.unique().tolist()) <= {4, 5, 6, 7, 8}


def test_mlm_all_special_vocab_raises() -> None:
    tokens, lengths = random_batch(4, 8, 12, seed=0)
    with pytest.raises(ValueError):
        mask_for_mlm(
            tokens,
            lengths,
            mask_id=1,
            vocab_size=2,
            special_ids=[0],
            generator=gen(0),
            mask_frac=0.0,
            random_frac=1.0,
        )


def test_mlm_prob_zero_chooses_nothing() -> None:
    tokens, lengths = random_batch(16, 20, VOCAB, seed=3)
    inputs, targets = run_mlm(tokens, lengths, prob=0.0)
    assert bool((targets == IGNORE_INDEX).all())
    assert torch.equal(inputs, tokens)


@pytest.mark.parametrize("bad", [{"prob": 1.5}, {"mask_frac": 0.9, "random_frac": 0.2}])
def test_mlm_rejects_bad_probabilities(bad: dict[str, float]) -> None:
    tokens, lengths = random_batch(2, 4, VOCAB, seed=0)
    with pytest.raises(ValueError):
        run_mlm(tokens, lengths, **bad)


# ---------------------------------------------------------------------------------------
# drop_and_shuffle
# ---------------------------------------------------------------------------------------


def test_drop_and_shuffle_statistics_and_displacement() -> None:
    k = 3
    tokens, lengths = position_batch(512, 100, min_len=0, seed=4)
    out, new_lengths = drop_and_shuffle(tokens, lengths, pad_id=PAD, generator=gen(0))
    assert_left_aligned(out, new_lengths)
    assert out.size(1) == int(new_lengths.max())

    kept_total = 0
    moved = 0
    for b in range(tokens.size(0)):
        n = int(lengths[b])
        output = row(out, new_lengths, b)
        if n > 0:
            assert len(output) >= 1, "a non-empty row keeps at least one token"
        # Unique ids: the kept tokens are those seen, with no duplicates and nothing new.
        kept = sorted(output)
        assert len(set(output)) == len(output)
        assert all(FIRST_REAL <= t < FIRST_REAL + n for t in output)
        # The rank of a token among the kept ones is its position before the shuffle.
        rank = {t: i for i, t in enumerate(kept)}
        for position, t in enumerate(output):
            assert abs(position - rank[t]) <= k
            moved += position != rank[t]
        kept_total += len(output)
    drop_rate = 1 - kept_total / lengths.sum().item()
    assert abs(drop_rate - 0.1) < 0.01
    assert moved > 0.5 * kept_total  # the shuffle does shuffle


def test_shuffle_reaches_the_window_and_respects_smaller_ones() -> None:
    tokens, lengths = position_batch(256, 60, min_len=60, seed=5)
    for k in (0, 1, 2, 5):
        out, new_lengths = drop_and_shuffle(
            tokens, lengths, pad_id=PAD, generator=gen(k), drop_prob=0.0, shuffle_window=k
        )
        assert torch.equal(new_lengths, lengths)
        displacement = (out - tokens).abs()  # ids equal FIRST_REAL + original position
        assert int(displacement.max()) == k  # k is reached on a batch this large
        assert torch.equal(out.sort(dim=1).values, tokens)


def test_drop_everything_keeps_one_token_per_row() -> None:
    tokens, lengths = position_batch(64, 10, min_len=0, seed=6)
    out, new_lengths = drop_and_shuffle(
        tokens, lengths, pad_id=PAD, generator=gen(0), drop_prob=1.0
    )
    assert new_lengths.tolist() == (lengths > 0).long().tolist()
    assert out.size(1) == 1
    for b in range(tokens.size(0)):
        if lengths[b] > 0:
            assert FIRST_REAL <= int(out[b, 0]) < FIRST_REAL + int(lengths[b])
    # The kept token is chosen uniformly, not always the first.
    assert len(set(out[lengths > 0, 0].tolist())) > 3


# ---------------------------------------------------------------------------------------
# infill_spans
# ---------------------------------------------------------------------------------------


def reconstruct_infilling(
    tokens: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, new_lengths: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Per row: tokens removed and masks inserted, checking the output is consistent."""
    removed_per_row, masks_per_row = [], []
    for b in range(tokens.size(0)):
        n = int(lengths[b])
        output = row(out, new_lengths, b)
        next_position, removed, masks = 0, 0, 0
        gap_removed, gap_masks = 0, 0
        for t in [*output, None]:
            if t == MASK:
                gap_masks += 1
                continue
            position = n if t is None else t - FIRST_REAL
            assert next_position <= position <= n, "kept tokens stay in order, none invented"
            gap_removed = position - next_position
            # Every removed stretch is replaced by at least one mask.
            assert gap_removed == 0 or gap_masks >= 1
            removed += gap_removed
            masks += gap_masks
            gap_masks = 0
            next_position = position + 1
        removed_per_row.append(removed)
        masks_per_row.append(masks)
        assert len(output) == n - removed + masks
    return removed_per_row, masks_per_row


def test_infilling_statistics() -> None:
    tokens, lengths = position_batch(128, 1000, min_len=500, seed=7)
    out, new_lengths = infill_spans(tokens, lengths, mask_id=MASK, pad_id=PAD, generator=gen(0))
    assert_left_aligned(out, new_lengths)
    assert out.size(1) == int(new_lengths.max())
    removed, masks = reconstruct_infilling(tokens, lengths, out, new_lengths)
    # Exactly ceil(0.35 n) tokens are covered in every row.
    assert removed == [math.ceil(0.35 * n) for n in lengths.tolist()]
    # One mask per span: the mean span length (zero-length spans included, as in the
    # Poisson mean) is near 3.5. The shortened last span of each row pulls it down by
    # about 0.02 here; the standard error of the estimate is about 0.02.
    mean_span = sum(removed) / sum(masks)
    assert abs(mean_span - 3.5) < 0.1
    # The masks mark spans, not tokens: far fewer masks than removed tokens.
    assert sum(masks) < 0.35 * sum(removed)


def test_infilling_spans_have_poisson_lengths() -> None:
    # With spans rare (ratio 5%), adjacent spans are rare too, so a lone mask between two
    # kept tokens is one span, and the gap it leaves has the span's length. Rows are long
    # so that the shortened last span of each row (1 in ~57 here) barely shifts the law.
    width = 4000
    tokens, lengths = position_batch(64, width, min_len=width, seed=8)
    out, new_lengths = infill_spans(
        tokens, lengths, mask_id=MASK, pad_id=PAD, generator=gen(1), ratio=0.05
    )
    lone_mask_gaps = []
    for b in range(tokens.size(0)):
        output = row(out, new_lengths, b)
        for i, t in enumerate(output):
            prev = output[i - 1] if i > 0 else FIRST_REAL - 1
            following = output[i + 1] if i + 1 < len(output) else FIRST_REAL + width
            if t == MASK and prev != MASK and following != MASK:
                lone_mask_gaps.append(following - prev - 1)
    assert len(lone_mask_gaps) > 3000
    counts = torch.bincount(torch.tensor(lone_mask_gaps), minlength=12).double()
    observed = counts / counts.sum()
    poisson = torch.distributions.Poisson(3.5).log_prob(torch.arange(12.0)).exp().double()
    # Lengths 0..7 carry 97% of the mass; each share within 3 points (about 4 standard
    # errors) of the Poisson law. Length 0 is an inserted mask that removes nothing.
    assert bool(((observed[:8] - poisson[:8]).abs() < 0.03).all()), observed[:8]


def test_infilling_ratio_extremes() -> None:
    tokens, lengths = position_batch(32, 50, min_len=0, seed=9)
    out, new_lengths = infill_spans(
        tokens, lengths, mask_id=MASK, pad_id=PAD, generator=gen(0), ratio=0.0
    )
    assert torch.equal(new_lengths, lengths)
    assert torch.equal(out, tokens[:, : int(lengths.max())])
    out, new_lengths = infill_spans(
        tokens, lengths, mask_id=MASK, pad_id=PAD, generator=gen(0), ratio=1.0
    )
    real = real_token_mask(new_lengths, out.size(1))
    assert bool((out[real] == MASK).all())
    assert bool(((new_lengths > 0) == (lengths > 0)).all())


def test_infilling_rejects_bad_lambda() -> None:
    tokens, lengths = position_batch(2, 5, min_len=1, seed=0)
    with pytest.raises(ValueError):
        infill_spans(tokens, lengths, mask_id=MASK, pad_id=PAD, generator=gen(0), poisson_lambda=0)


# ---------------------------------------------------------------------------------------
# permute_sentences and sentence_boundary_ids
# ---------------------------------------------------------------------------------------

DOT, BANG = 4, 5
BOUNDARIES = (DOT, BANG)


def segments(ids: list[int]) -> list[tuple[int, ...]]:
    """Reference split: after a run of boundary tokens."""
    result: list[tuple[int, ...]] = []
    current: list[int] = []
    for i, t in enumerate(ids):
        current.append(t)
        if t in BOUNDARIES and (i + 1 == len(ids) or ids[i + 1] not in BOUNDARIES):
            result.append(tuple(current))
            current = []
    if current:
        result.append(tuple(current))
    return result


def sentence_batch(batch_size: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids per position, with about one token in six replaced by "." or "!"."""
    tokens, lengths = position_batch(batch_size, width, min_len=0, seed=seed)
    g = gen(seed + 1000)
    boundary = torch.rand(tokens.shape, generator=g) < 1 / 6
    which = torch.randint(0, 2, tokens.shape, generator=g)
    tokens = torch.where(boundary, torch.tensor(BOUNDARIES)[which], tokens)
    tokens[~real_token_mask(lengths, width)] = PAD
    return tokens, lengths


def test_permute_sentences_keeps_segments() -> None:
    tokens, lengths = sentence_batch(256, 60, seed=10)
    out, new_lengths = permute_sentences(
        tokens, lengths, boundary_ids=BOUNDARIES, pad_id=PAD, generator=gen(0)
    )
    assert out.shape == tokens.shape
    assert torch.equal(new_lengths, lengths)
    assert_left_aligned(out, new_lengths)
    changed = 0
    for b in range(tokens.size(0)):
        before, after = row(tokens, lengths, b), row(out, lengths, b)
        original = segments(before)
        # The output is the original segments, concatenated in some order.
        assert _is_reordering(original, after)
        assert sorted(before) == sorted(after)
        if len(original) <= 1:
            assert after == before
        changed += after != before
    assert changed > 200


def _is_reordering(original: list[tuple[int, ...]], after: list[int]) -> bool:
    # Re-splitting the output would merge the row's tail (a segment without a final
    # boundary) with whatever follows it, so match the original segments greedily instead:
    # every segment but a row's first starts with a unique id, so the match is unambiguous.
    remaining = list(original)
    position = 0
    while position < len(after):
        for segment in remaining:
            if tuple(after[position : position + len(segment)]) == segment:
                remaining.remove(segment)
                position += len(segment)
                break
        else:
            return False
    return not remaining


def test_permute_sentences_is_uniform_over_orders() -> None:
    # Three sentences: each of the 6 orders should appear about 1/6 of the time.
    sentence = [20, 21, DOT, 30, BANG, 40, 41, 42, DOT]
    tokens = torch.tensor(sentence).expand(6000, -1).clone()
    lengths = torch.full((6000,), len(sentence))
    out, _ = permute_sentences(
        tokens, lengths, boundary_ids=BOUNDARIES, pad_id=PAD, generator=gen(0)
    )
    orders = torch.unique(out, dim=0, return_counts=True)[1]
    assert orders.numel() == 6
    assert bool(((orders / 6000.0 - 1 / 6).abs() < 0.02).all())


def test_permute_sentences_single_segment_and_no_boundaries() -> None:
    tokens, lengths = position_batch(8, 12, min_len=0, seed=11)
    out, _ = permute_sentences(tokens, lengths, boundary_ids=[DOT], pad_id=PAD, generator=gen(0))
    assert torch.equal(out, tokens)
    out, _ = permute_sentences(tokens, lengths, boundary_ids=[], pad_id=PAD, generator=gen(0))
    assert torch.equal(out, tokens)


def test_sentence_boundary_ids() -> None:
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        "▁.",
        ".",
        '."',
        "▁Hello",
        "?)",
        "。",
        "！",
        "▁",
        "।",
        "▁Dr.",
        "▁a",
        "...",
        "؟",
        ",",
        "<0x2E>",
    ]
    assert sentence_boundary_ids(pieces) == [3, 4, 5, 7, 8, 9, 11, 12, 14, 15]


# ---------------------------------------------------------------------------------------
# Shared properties: determinism and edge cases
# ---------------------------------------------------------------------------------------


def _mlm(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator):
    return mask_for_mlm(
        tokens, lengths, mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIAL, generator=g
    )


def _drop(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator):
    return drop_and_shuffle(tokens, lengths, pad_id=PAD, generator=g)


def _infill(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator):
    return infill_spans(tokens, lengths, mask_id=MASK, pad_id=PAD, generator=g)


def _permute(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator):
    return permute_sentences(tokens, lengths, boundary_ids=BOUNDARIES, pad_id=PAD, generator=g)


NOISERS: dict[str, Noiser] = {
    "mlm": _mlm,
    "drop_and_shuffle": _drop,
    "infill": _infill,
    "permute": _permute,
}


@pytest.mark.parametrize("name", list(NOISERS))
def test_same_seed_same_output_different_seed_different_output(name: str) -> None:
    noiser = NOISERS[name]
    tokens, lengths = sentence_batch(64, 40, seed=12)
    first = noiser(tokens, lengths, gen(5))
    second = noiser(tokens, lengths, gen(5))
    other = noiser(tokens, lengths, gen(6))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(first, other, strict=True)
    )


@pytest.mark.parametrize("name", list(NOISERS))
def test_global_rng_is_neither_used_nor_disturbed(name: str) -> None:
    tokens, lengths = sentence_batch(16, 20, seed=13)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    NOISERS[name](tokens, lengths, gen(1))
    assert torch.equal(torch.rand(3), before)


@pytest.mark.parametrize("name", list(NOISERS))
@pytest.mark.parametrize(
    ("lengths_list", "width"),
    [([0, 0, 0], 5), ([0, 1, 0, 1], 4), ([1, 1], 1), ([0, 1, 0], 1), ([0], 0), ([], 3)],
    ids=["all-pad", "empty-and-length-1", "T=1", "T=1-with-empty", "T=0", "B=0"],
)
def test_edge_cases(name: str, lengths_list: list[int], width: int) -> None:
    lengths = torch.tensor(lengths_list, dtype=torch.int64)
    tokens = (FIRST_REAL + torch.arange(width)).expand(len(lengths_list), width).clone()
    tokens[~real_token_mask(lengths, width)] = PAD
    out, second = NOISERS[name](tokens, lengths, gen(0))
    assert out.size(0) == len(lengths_list)
    if name == "mlm":
        inputs, targets = out, second
        assert inputs.shape == targets.shape == tokens.shape
        chosen = targets != IGNORE_INDEX
        # A length-1 row always has its one token chosen; empty rows nothing.
        assert chosen.sum(dim=1).tolist() == [min(n, 1) for n in lengths_list]
        assert bool((inputs[~real_token_mask(lengths, width)] == PAD).all())
        return
    new_lengths = second
    assert_left_aligned(out, new_lengths)
    empty = lengths == 0
    assert bool((new_lengths[empty] == 0).all()), "empty rows stay empty"
    if name == "infill":
        # A length-1 row becomes masks only: ceil(0.35) = 1 token covered.
        ones = lengths == 1
        assert bool((out[ones, :1] == MASK).all())
        assert out.size(1) == (int(new_lengths.max()) if len(lengths_list) else 0)
    else:
        # One token: nothing to drop (one is always kept), shuffle or permute.
        assert torch.equal(new_lengths, lengths)
        ones = lengths == 1
        assert out[ones][:, :1].tolist() == tokens[ones][:, :1].tolist()
        assert out.size(1) == (width if name == "permute" else max(lengths_list, default=0))


def test_invalid_batches_are_rejected() -> None:
    tokens = torch.full((2, 3), FIRST_REAL)
    for lengths in (torch.tensor([4, 1]), torch.tensor([-1, 1]), torch.tensor([1, 1, 1])):
        with pytest.raises(ValueError):
            _drop(tokens, lengths, gen(0))
    with pytest.raises(ValueError):
        _drop(tokens[0], torch.tensor([1]), gen(0))
