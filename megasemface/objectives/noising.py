"""Batched, vectorised noising functions for the pre-training objectives.

Each function takes a padded batch and returns a noised one, with no Python loop over
rows or tokens:

- :func:`mask_for_mlm`: BERT/XLM masked language modelling (80% mask, 10% random, 10% kept).
- :func:`drop_and_shuffle`: the noise C(x) of Lample et al. (2018), "Unsupervised machine
  translation using monolingual corpora only", which SemFace uses when pre-training the
  decoder (word dropping, then a local shuffle that moves no token more than k positions).
- :func:`infill_spans`: mBART/BART text infilling (Poisson spans, one mask token per span).
- :func:`permute_sentences`: mBART sentence permutation.
- :func:`sentence_boundary_ids`: which SentencePiece pieces end a sentence, for
  :func:`permute_sentences`.

Batch layout (input and output alike): ``tokens`` [B, T] int64 with the real tokens of a
row at its start, followed by ``pad_id``, and ``lengths`` [B] int64 counting the real
tokens. Special tokens (BOS, EOS, language tags) are added later, so every real position
may be noised.

Randomness comes only from the ``generator`` argument, never from the global RNG, so a
seeded generator reproduces the output exactly. Random numbers are drawn on the
generator's device and moved to the batch's device, so a CPU generator also works for a
batch on the GPU (and gives the same result there). The output of a row depends on the
other rows of its batch through the shapes of the random draws, so the same row noised in
another batch gets different noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "IGNORE_INDEX",
    "SENTENCE_TERMINATORS",
    "drop_and_shuffle",
    "infill_spans",
    "mask_for_mlm",
    "pack_left",
    "permute_sentences",
    "random_ranks",
    "real_token_mask",
    "sentence_boundary_ids",
]

IGNORE_INDEX = -100
"""Target of positions without a prediction (the default ``ignore_index`` of
``torch.nn.functional.cross_entropy``)."""

SENTENCE_TERMINATORS = frozenset(
    ".!?"  # Latin, Cyrillic, Greek (which also uses ";" as a question mark, left out: ambiguous)
    "\u3002\uff01\uff1f\uff0e\uff61"  # CJK full stop, fullwidth ! ? . and halfwidth ideographic
    "\u0964\u0965"  # Devanagari danda and double danda (Hindi, Nepali, Marathi, ...)
    "\u061f\u06d4"  # Arabic question mark, Urdu full stop
    "\u0589"  # Armenian full stop
    "\u1362"  # Ethiopic full stop (Amharic)
    "\u104a\u104b"  # Myanmar section marks
    "\u0f0d"  # Tibetan shad
    "\u2026\u203c\u2047\u2048\u2049"  # ellipsis and the double ! ? marks
)
"""Characters that end a sentence when they end a piece."""

# Closing quotes and brackets may follow the terminator inside one piece ('."', '?)'); they
# are stripped before looking at the last character.
_CLOSING_PUNCTUATION = "\"')]}\u2019\u201d\u00bb\u203a\u300d\u300f\u3011\uff09"

# SentencePiece's word-boundary marker, U+2581 LOWER ONE EIGHTH BLOCK.
_SPM_SPACE = "\u2581"


# ---------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------


def real_token_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Marks the real (non-pad) positions of a left-aligned batch.

    Args:
        lengths: [B] int64, real tokens per row.
        width: T, the padded width.

    Returns:
        [B, T] bool, True at ``t < lengths[b]``.
    """
    return torch.arange(width, device=lengths.device) < lengths[:, None]


def pack_left(
    tokens: torch.Tensor, keep: torch.Tensor, *, pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves the kept tokens of each row to its start, in order, and pads the rest.

    Args:
        tokens: [B, T] token ids.
        keep: [B, T] bool, the positions to keep.
        pad_id: id written after the kept tokens.
        width: width of the result; None trims it to the longest output row (0 when every
            row is empty).

    Returns:
        ``(packed, lengths)``: packed [B, width] and lengths [B] int64, the kept count.
    """
    if keep.shape != tokens.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)}, tokens {tuple(tokens.shape)}")
    new_lengths = keep.sum(dim=1)
    longest = int(new_lengths.max()) if new_lengths.numel() else 0
    if width is None:
        width = longest
    elif width < longest:
        raise ValueError(f"width {width} is shorter than the longest kept row ({longest})")
    packed = tokens.new_full((tokens.size(0), width), pad_id)
    # The destination of a kept token is the number of kept tokens before it in its row.
    destination = keep.cumsum(dim=1) - 1
    rows = torch.arange(tokens.size(0), device=tokens.device)[:, None].expand_as(keep)
    packed[rows[keep], destination[keep]] = tokens[keep]
    return packed, new_lengths


def random_ranks(valid: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Ranks the valid entries of each row in a uniformly random order.

    The valid entries of a row with n of them get a uniformly random permutation of
    0..n-1; the invalid ones get the ranks n.. (in position order). Choosing "rank < m"
    therefore samples m valid positions without replacement, and using the rank as a new
    position shuffles them.

    Args:
        valid: [B, N] bool.
        generator: the source of randomness.

    Returns:
        [B, N] int64 ranks; each row is a permutation of 0..N-1.
    """
    scores = _uniform(valid.shape, generator, valid.device)
    # Uniform scores lie in [0, 1), so 2 sends the invalid entries after every valid one;
    # the stable sort keeps them in position order.
    scores = scores.masked_fill(~valid, 2.0)
    order = scores.argsort(dim=1, stable=True)
    positions = torch.arange(valid.size(1), device=valid.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def _uniform(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """U[0, 1) float64 samples drawn on the generator's device, returned on ``device``.

    float64 keeps sort keys such as ``i + U(0, k + 1)`` exact enough for long rows.
    """
    sample = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64)
    return sample.to(device)


def _check_batch(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Validates the batch layout; returns ``lengths`` as int64 on the tokens' device."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must hold integer ids, got {tokens.dtype}")
    if lengths.shape != (tokens.size(0),):
        raise ValueError(
            f"lengths must be [B] = [{tokens.size(0)}], got shape {tuple(lengths.shape)}"
        )
    lengths = lengths.to(device=tokens.device, dtype=torch.int64)
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > tokens.size(1)):
        raise ValueError(f"lengths must lie in [0, {tokens.size(1)}]")
    return lengths


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    """Sum of the preceding entries along dim 1 (0 for the first)."""
    return values.cumsum(dim=1) - values


# ---------------------------------------------------------------------------------------
# Masked language modelling (BERT, XLM)
# ---------------------------------------------------------------------------------------


def mask_for_mlm(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    generator: torch.Generator,
    prob: float = 0.15,
    mask_frac: float = 0.8,
    random_frac: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT/XLM masking: picks ``prob`` of the real tokens as prediction targets.

    Each row gets ``round(prob * length)`` targets, at least one when the row is non-empty
    and ``prob > 0`` (as BERT's data generator does), at uniformly random positions. Each
    target is then independently replaced by ``mask_id`` with probability ``mask_frac``, by
    a random token with probability ``random_frac``, and kept otherwise. Random tokens are
    uniform over ``[0, vocab_size)`` minus ``special_ids`` and ``mask_id``, so the noise
    never produces a pad, BOS, EOS or language tag; pass them all in ``special_ids``.

    Args:
        tokens: [B, T] int64 token ids.
        lengths: [B] int64 real tokens per row.
        mask_id: id of the mask token.
        vocab_size: size of the vocabulary the random tokens come from.
        special_ids: ids random replacement must never produce.
        generator: the source of randomness.
        prob: share of the real tokens to predict.
        mask_frac: share of the targets replaced by ``mask_id``.
        random_frac: share of the targets replaced by a random token.

    Returns:
        ``(inputs, targets)``, both [B, T] int64: ``inputs`` is the noised batch (pads
        untouched); ``targets`` holds the original id at the target positions and
        :data:`IGNORE_INDEX` everywhere else.
    """
    lengths = _check_batch(tokens, lengths)
    _check_probability("prob", prob)
    _check_probability("mask_frac", mask_frac)
    _check_probability("random_frac", random_frac)
    if mask_frac + random_frac > 1.0:
        raise ValueError(f"mask_frac + random_frac must be <= 1, got {mask_frac + random_frac}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    device = tokens.device
    real = real_token_mask(lengths, tokens.size(1))

    # Exact counts per row rather than independent Bernoulli draws: the number of targets
    # then does not vary with luck, and even short rows get a target.
    num_targets = torch.round(lengths.to(torch.float64) * prob).to(torch.int64)
    if prob > 0.0:
        num_targets = torch.where(lengths > 0, num_targets.clamp(min=1), num_targets)
    num_targets = torch.minimum(num_targets, lengths)
    chosen = (random_ranks(real, generator) < num_targets[:, None]) & real

    action = _uniform(tokens.shape, generator, device)
    to_mask = chosen & (action < mask_frac)
    to_random = chosen & (action >= mask_frac) & (action < mask_frac + random_frac)

    inputs = tokens.clone()
    inputs[to_mask] = mask_id
    num_random = int(to_random.sum())
    if num_random:
        allowed = torch.ones(vocab_size, dtype=torch.bool)
        excluded = torch.tensor([i for i in (*special_ids, mask_id) if 0 <= i < vocab_size])
        allowed[excluded.to(torch.int64)] = False
        candidates = allowed.nonzero().squeeze(1)
        if candidates.numel() == 0:
            raise ValueError("every id of the vocabulary is special: no random replacement left")
        picks = torch.randint(
            candidates.numel(), (num_random,), generator=generator, device=generator.device
        )
        inputs[to_random] = candidates.to(generator.device)[picks].to(device, tokens.dtype)

    targets = torch.full(tokens.shape, IGNORE_INDEX, dtype=torch.int64, device=device)
    targets[chosen] = tokens[chosen].to(torch.int64)
    return inputs, targets


# ---------------------------------------------------------------------------------------
# Word dropping and local shuffle (Lample et al. 2018), the C(x) of SemFace
# ---------------------------------------------------------------------------------------


def drop_and_shuffle(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    pad_id: int,
    generator: torch.Generator,
    drop_prob: float = 0.1,
    shuffle_window: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise C(x) of Lample et al. (2018): word dropping, then a local shuffle.

    Each real token is dropped independently with probability ``drop_prob``; a non-empty
    row that would lose every token keeps one, chosen uniformly. The remaining tokens of a
    row are then permuted by sorting ``q_i = i + U(0, k + 1)`` with ``k = shuffle_window``
    (the paper's alpha = k + 1), which guarantees ``|sigma(i) - i| <= k``: a token can only
    overtake, or be overtaken by, tokens fewer than k + 1 positions away, and there are at
    most k of those on each side.

    Args:
        tokens: [B, T] int64 token ids.
        lengths: [B] int64 real tokens per row.
        pad_id: id of the padding.
        generator: the source of randomness.
        drop_prob: probability of dropping each token.
        shuffle_window: k, the largest displacement of a token (0: no shuffle).

    Returns:
        ``(tokens, lengths)``: the noised rows left-aligned in [B, T'] where T' is the
        longest output row (T' <= T), and their lengths [B].
    """
    lengths = _check_batch(tokens, lengths)
    _check_probability("drop_prob", drop_prob)
    if shuffle_window < 0:
        raise ValueError(f"shuffle_window must be >= 0, got {shuffle_window}")
    device = tokens.device
    real = real_token_mask(lengths, tokens.size(1))

    keep = real & (_uniform(tokens.shape, generator, device) >= drop_prob)
    # An empty source gives the decoder nothing to condition on; keep one token instead,
    # as the reference implementation (XLM's word_dropout) does.
    emptied = (lengths > 0) & ~keep.any(dim=1)
    if bool(emptied.any()):
        keep |= emptied[:, None] & (random_ranks(real, generator) == 0)
    packed, new_lengths = pack_left(tokens, keep, pad_id=pad_id)

    if shuffle_window == 0 or packed.size(1) <= 1:
        return packed, new_lengths
    width = packed.size(1)
    keys = torch.arange(width, device=device, dtype=torch.float64) + (shuffle_window + 1) * (
        _uniform(packed.shape, generator, device)
    )
    # Pads sort after every real token and, the sort being stable, stay in place.
    keys = keys.masked_fill(~real_token_mask(new_lengths, width), math.inf)
    order = keys.argsort(dim=1, stable=True)
    return packed.gather(1, order), new_lengths


# ---------------------------------------------------------------------------------------
# Text infilling (BART, mBART)
# ---------------------------------------------------------------------------------------


def infill_spans(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mask_id: int,
    pad_id: int,
    generator: torch.Generator,
    ratio: float = 0.35,
    poisson_lambda: float = 3.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mBART/BART text infilling: Poisson-length spans, each replaced by one mask token.

    For a row of n tokens, ``L = ceil(ratio * n)`` tokens are masked (ceil, as fairseq's
    denoising dataset does, so every non-empty row is noised when ``ratio > 0``). Span
    lengths are drawn from Poisson(``poisson_lambda``) until they add up to at least L, and
    the last one is shortened so that they add up to exactly L. The m spans are then placed
    uniformly at random without overlap: the row is treated as a sequence of ``n - L``
    unmasked tokens and m spans, and a uniformly random subset of its ``n - L + m`` slots
    holds the spans, in random order. Every span becomes one ``mask_id``; a span of length
    0 therefore inserts a mask token, as in BART. Two spans can be adjacent, giving two
    consecutive masks.

    Sampling the span lengths draws Poisson variates for the whole batch at once; in the
    rare case that some row's draws fall short of its budget, more columns are drawn (a
    loop over a few batched draws, never over tokens).

    Args:
        tokens: [B, T] int64 token ids.
        lengths: [B] int64 real tokens per row.
        mask_id: id of the mask token.
        pad_id: id of the padding.
        generator: the source of randomness.
        ratio: share of each row's tokens to mask.
        poisson_lambda: mean span length (> 0).

    Returns:
        ``(tokens, lengths)``: the noised rows left-aligned in [B, T'] where T' is the
        longest output row, and their lengths [B] (``n - L + m``). Rows usually get
        shorter, but a very short row can get longer than n when several zero-length spans
        insert masks, so T' may exceed T by a few tokens.
    """
    lengths = _check_batch(tokens, lengths)
    _check_probability("ratio", ratio)
    if not poisson_lambda > 0.0:
        raise ValueError(f"poisson_lambda must be > 0, got {poisson_lambda}")
    device = tokens.device
    width = tokens.size(1)

    # The epsilon keeps ratio * n = 7.000000000000001 from rounding up to 8.
    budget = torch.ceil(lengths.to(torch.float64) * ratio - 1e-9).clamp(min=0).to(torch.int64)
    budget = torch.minimum(budget, lengths)
    max_budget = int(budget.max()) if budget.numel() else 0
    if max_budget == 0:
        return pack_left(tokens, real_token_mask(lengths, width), pad_id=pad_id)

    span_lengths = _poisson_spans_covering(budget, poisson_lambda, generator).to(device)
    covered = span_lengths.cumsum(dim=1)
    # m: spans up to and including the first whose cumulative length reaches the budget.
    num_spans = torch.where(budget > 0, (covered < budget[:, None]).sum(dim=1) + 1, 0)
    max_spans = int(num_spans.max())
    span_lengths, covered = span_lengths[:, :max_spans], covered[:, :max_spans]
    span_index = torch.arange(max_spans, device=device)
    last = num_spans[:, None] - 1
    trimmed_last = budget[:, None] - (covered - span_lengths)  # >= 1 by the choice of m
    span_lengths = torch.where(span_index < last, span_lengths, trimmed_last)
    span_lengths = span_lengths.masked_fill(span_index >= num_spans[:, None], 0)

    # Slots: the n - L unmasked tokens plus the m spans, in output order.
    num_slots = lengths - budget + num_spans
    num_out = int(num_slots.max())
    valid_slot = real_token_mask(num_slots, num_out)
    slot_rank = random_ranks(valid_slot, generator)
    # Ranks of the valid slots are a uniform permutation, so the m lowest pick a uniform
    # subset for the spans, and the rank itself assigns the spans to them in random order.
    is_span = valid_slot & (slot_rank < num_spans[:, None])
    span_of_slot = slot_rank.clamp(max=max_spans - 1)
    consumed = torch.where(is_span, span_lengths.gather(1, span_of_slot), 1)
    consumed = consumed.masked_fill(~valid_slot, 0)
    # An unmasked slot copies the input token at the number of input tokens consumed
    # before it; clamping only affects slots whose value is replaced below.
    source = _exclusive_cumsum(consumed).clamp(max=width - 1)
    out = tokens.gather(1, source)
    out = out.masked_fill(is_span, mask_id).masked_fill(~valid_slot, pad_id)
    return out, num_slots


def _poisson_spans_covering(
    budget: torch.Tensor, poisson_lambda: float, generator: torch.Generator
) -> torch.Tensor:
    """Poisson span lengths [B, S] whose row sums reach ``budget`` [B] in every row.

    Returns int64 on the generator's device.
    """
    batch_size = budget.size(0)
    budget = budget.to(generator.device)
    max_budget = int(budget.max())
    # Enough draws for the largest budget with high probability (mean plus four standard
    # deviations of the number of draws needed), so the loop below rarely runs twice.
    expected = max_budget / poisson_lambda
    columns = math.ceil(expected + 4.0 * math.sqrt(expected)) + 2
    draws: list[torch.Tensor] = []
    total = torch.zeros(batch_size, dtype=torch.int64, device=generator.device)
    while True:
        rates = torch.full(
            (batch_size, columns), poisson_lambda, dtype=torch.float64, device=generator.device
        )
        block = torch.poisson(rates, generator=generator).to(torch.int64)
        draws.append(block)
        total = total + block.sum(dim=1)
        if bool((total >= budget).all()):
            return torch.cat(draws, dim=1)
        columns = sum(d.size(1) for d in draws)  # double the draws each time


# ---------------------------------------------------------------------------------------
# Sentence permutation (mBART)
# ---------------------------------------------------------------------------------------


def permute_sentences(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    boundary_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mBART sentence permutation: shuffles the sentences of each row.

    A row is split after each token whose id is in ``boundary_ids``; a run of consecutive
    boundary tokens ("?", "!") ends a single sentence, as in fairseq's
    ``permute_sentences``, so no segment is made of punctuation alone. Text after the last
    boundary forms a final segment. The segments of each row are put in a uniformly random
    order; a row with one segment is unchanged.

    Args:
        tokens: [B, T] int64 token ids.
        lengths: [B] int64 real tokens per row.
        boundary_ids: ids of tokens that end a sentence (see :func:`sentence_boundary_ids`).
        pad_id: id of the padding (the padding is left untouched).
        generator: the source of randomness.

    Returns:
        ``(tokens, lengths)``: [B, T] with each row's segments permuted, and the unchanged
        lengths [B].
    """
    lengths = _check_batch(tokens, lengths)
    device = tokens.device
    batch_size, width = tokens.shape
    if width == 0 or batch_size == 0 or not boundary_ids:
        return tokens.clone(), lengths
    real = real_token_mask(lengths, width)
    boundary_set = torch.tensor(list(boundary_ids), dtype=tokens.dtype, device=device)
    is_boundary = torch.isin(tokens, boundary_set) & real
    next_is_boundary = torch.cat([is_boundary[:, 1:], is_boundary.new_zeros(batch_size, 1)], dim=1)
    ends = (is_boundary & ~next_is_boundary).to(torch.int64)
    # The segment of a token is the number of sentence ends strictly before it.
    segment = _exclusive_cumsum(ends)
    last_real = (lengths - 1).clamp(min=0)[:, None]
    num_segments = torch.where(lengths > 0, segment.gather(1, last_real).squeeze(1) + 1, 0)
    max_segments = int(num_segments.max())
    if max_segments <= 1:
        return tokens.clone(), lengths

    # Pads may carry a segment number past the last one; clamp it and give them weight 0.
    segment = segment.clamp(max=max_segments - 1)
    segment_lengths = torch.zeros(batch_size, max_segments, dtype=torch.int64, device=device)
    segment_lengths.scatter_add_(1, segment, real.to(torch.int64))
    old_start = _exclusive_cumsum(segment_lengths)
    # new_rank[b, s]: where old segment s goes. Missing segments (s >= num_segments) rank
    # last and have length 0, so they shift nothing.
    new_rank = random_ranks(real_token_mask(num_segments, max_segments), generator)
    lengths_in_new_order = torch.zeros_like(segment_lengths).scatter_(1, new_rank, segment_lengths)
    new_start = _exclusive_cumsum(lengths_in_new_order).gather(1, new_rank)

    positions = torch.arange(width, device=device).expand(batch_size, width)
    offset = positions - old_start.gather(1, segment)
    destination = torch.where(real, new_start.gather(1, segment) + offset, positions)
    # destination is a permutation of each row (real tokens among themselves, pads fixed).
    permuted = torch.empty_like(tokens).scatter_(1, destination, tokens)
    return permuted, lengths


def sentence_boundary_ids(pieces: Sequence[str]) -> list[int]:
    """Ids of the SentencePiece pieces that end a sentence.

    A piece ends a sentence when its text, without the "▁" word-boundary marker and
    without trailing closing quotes or brackets, ends in one of
    :data:`SENTENCE_TERMINATORS` (".", "!", "?", "。", "！", "？", "।", ...). Abbreviation
    pieces such as "▁Dr." also qualify; for sentence permutation (a noise) an occasional
    split inside a sentence is harmless.

    Args:
        pieces: the vocabulary in id order, e.g. ``[sp.id_to_piece(i) for i in
            range(sp.get_piece_size())]``.

    Returns:
        The ids, ascending.
    """
    ids = []
    for piece_id, piece in enumerate(pieces):
        text = piece.replace(_SPM_SPACE, "").rstrip(_CLOSING_PUNCTUATION)
        if text and text[-1] in SENTENCE_TERMINATORS:
            ids.append(piece_id)
    return ids
