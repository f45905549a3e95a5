"""Batched greedy and beam search over any sequence-to-sequence scorer.

The search only needs the two calls of :class:`Seq2SeqScorer` (``Seq2SeqModel`` has them; the
fine-tuning trainer wraps its DeepSpeed engine in an adapter with the same two methods).
Sequence layout (see ``megasemface/objectives/sequences.py``): the encoder reads ``x </s>``
with the source language's index; the decoder prefix starts with the target language's tag
token and the decoder reads the target language's index; a hypothesis ends at ``</s>``.

Scores are fairseq's: the sum of the token log-probabilities, ``</s>`` included, divided by
``length ** lenpen`` where ``length`` counts the generated tokens and ``</s>``. Generation is
forced to end (``</s>`` with its real log-probability) after ``max_len_a * source_length +
max_len_b`` tokens, ``source_length`` counting the source's ``</s>`` as fairseq does, capped so
that every prefix fits the decoder's position embeddings.

**Lockstep across ranks.** Under ZeRO-3 every forward call gathers parameters with collective
calls, so every rank must run the same number of ``encode`` and ``decode_step`` calls even
when its sentences end sooner. With ``keep_going`` the loop asks, once per step, whether any
rank still has unfinished rows (the caller implements it, e.g. with an all-reduce of a flag)
and keeps calling ``decode_step`` on a one-row dummy once its own rows are done; an empty
local batch encodes a one-row dummy. Callers must also make every rank call the search the
same number of times (an empty batch is allowed for that).

**Device.** The search runs where the model is: the scorer's ``device`` attribute (an adapter
around an engine has one), else the device of its first parameter (a ``Seq2SeqModel``). Source
tensors on another device (a batch the loader or a caller built on the host) are moved there
first, and every tensor the search makes is made there.

Shapes: B sentences, K beam size, R decoder rows (B or B*K), S source length, T prefix length,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from megasemface.data.text.tokenizer import EOS_ID
from megasemface.inference.length_limits import MAX_LEN_A, MAX_LEN_B
from megasemface.nn.transformer import DecoderCache, EncoderOutput

__all__ = [
    "Hypothesis",
    "SearchConfig",
    "Seq2SeqScorer",
    "beam_search",
    "greedy_search",
    "max_lengths",
    "scorer_device",
    "search",
]

KeepGoing = Callable[[bool], bool]


class Seq2SeqScorer(Protocol):
    """What search needs from a model: ``Seq2SeqModel`` or an adapter around an engine."""

    def encode(
        self, src_BS: torch.Tensor, src_mask_BS: torch.Tensor, src_langs_B: torch.Tensor
    ) -> EncoderOutput: ...

    def decode_step(
        self,
        prefix_BT: torch.Tensor,
        tgt_langs_B: torch.Tensor,
        memory: EncoderOutput,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Log-probabilities [B, V] of the token after each prefix; a scorer may keep what it
        needs between steps in ``cache`` (the search keeps its rows in step with the prefixes'
        rows) or ignore it."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Decoding options (fairseq's names and defaults where they exist)."""

    beam: int = 1
    """Hypotheses kept per sentence; 1 is greedy search."""
    lenpen: float = 1.0
    """Length penalty: score = log-prob / length ** lenpen (> 1 favours longer outputs)."""
    max_len_a: float = MAX_LEN_A
    """Generated tokens are at most ``int(max_len_a * source_length + max_len_b)``..."""
    max_len_b: int = MAX_LEN_B
    """...capped by the decoder's position embeddings."""
    min_len: int = 0
    """``</s>`` is forbidden before ``int(min_len_a * source_length + min_len)`` tokens
    (unless the maximum comes first); this is the constant..."""
    min_len_a: float = 0.0
    """...and this the share of the source's length (with ``</s>``): 0.5 keeps a translation
    from ending before half its source's length."""
    no_repeat_ngram: int = 0
    """No n-gram of this size is generated twice in one output (fairseq's
    ``--no-repeat-ngram-size``); 0: no limit. Stops a weak model's loops ("the the the")."""
    incremental: bool = True
    """Keep the decoder's keys and values between steps (a :class:`DecoderCache`), so a step
    runs the new position only; off re-runs the decoder over every prefix."""
    exact_stop: bool = False
    """Beam search stops a sentence when none of its live hypotheses can beat its K finished
    ones. By default a live hypothesis is judged by its score if it ended now, which is exact
    for lenpen <= 0 and the usual heuristic otherwise (fairseq, Hugging Face); with
    ``exact_stop`` and lenpen > 0 it is judged by the best it could reach at the maximum length,
    which decodes longer for a search that can never stop too early."""

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise ValueError(
                f"max_len_a and max_len_b must be >= 0, got {self.max_len_a}, {self.max_len_b}"
            )
        if self.min_len < 0 or self.min_len_a < 0:
            raise ValueError(
                f"min_len and min_len_a must be >= 0, got {self.min_len}, {self.min_len_a}"
            )
        if self.no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be >= 0, got {self.no_repeat_ngram}")
        if not math.isfinite(self.lenpen):
            raise ValueError(f"lenpen must be finite, got {self.lenpen}")


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One output sentence."""

    tokens: list[int]
    """Generated ids, without the language tag and ``</s>``."""
    score: float
    """``log_prob / (len(tokens) + 1) ** lenpen``: what search ranks by."""
    log_prob: float
    """Sum of the log-probabilities of the tokens and ``</s>``."""


def max_lengths(
    src_lengths_B: torch.Tensor, config: SearchConfig, max_positions: int
) -> torch.Tensor:
    """Most tokens each sentence may generate before ``</s>`` is forced.

    The prefix that predicts the forced ``</s>`` is the tag plus that many tokens, so the cap
    is ``max_positions - 1``.
    """
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    wanted = (config.max_len_a * src_lengths_B.double() + config.max_len_b).floor().long()
    return wanted.clamp(max=max_positions - 1)


def min_lengths(src_lengths_B: torch.Tensor, config: SearchConfig) -> torch.Tensor:
    """Tokens each sentence must generate before ``</s>`` may end it (the maximum of
    :func:`max_lengths` still ends it first)."""
    return (config.min_len_a * src_lengths_B.double() + config.min_len).floor().long()


def search(
    scorer: Seq2SeqScorer,
    src_BS: torch.Tensor,
    src_mask_BS: torch.Tensor,
    src_langs_B: torch.Tensor,
    *,
    tgt_tags: int | torch.Tensor,
    tgt_langs: int | torch.Tensor,
    max_positions: int,
    config: SearchConfig,
    eos_id: int = EOS_ID,
    banned_ids: Sequence[int] = (),
    keep_going: KeepGoing | None = None,
) -> list[Hypothesis]:
    """Greedy search for ``config.beam == 1`` (without ``exact_stop``), beam search otherwise;
    arguments as :func:`greedy_search`."""
    fn = greedy_search if config.beam == 1 and not config.exact_stop else beam_search
    return fn(
        scorer,
        src_BS,
        src_mask_BS,
        src_langs_B,
        tgt_tags=tgt_tags,
        tgt_langs=tgt_langs,
        max_positions=max_positions,
        config=config,
        eos_id=eos_id,
        banned_ids=banned_ids,
        keep_going=keep_going,
    )


@torch.no_grad()  # not inference_mode: ZeRO-3 re-partitions parameters inside forward calls
def greedy_search(
    scorer: Seq2SeqScorer,
    src_BS: torch.Tensor,
    src_mask_BS: torch.Tensor,
    src_langs_B: torch.Tensor,
    *,
    tgt_tags: int | torch.Tensor,
    tgt_langs: int | torch.Tensor,
    max_positions: int,
    config: SearchConfig = SearchConfig(),
    eos_id: int = EOS_ID,
    banned_ids: Sequence[int] = (),
    keep_going: KeepGoing | None = None,
) -> list[Hypothesis]:
    """The most probable token at every step, for a batch of sentences.

    Args:
        scorer: the model (in eval mode: search does not change its mode).
        src_BS: source ids, each ``x </s>``, padded; may have no rows.
        src_mask_BS: True for real source tokens.
        src_langs_B: index of each source's language.
        tgt_tags: the target language's tag id, one for all or one per sentence [B].
        tgt_langs: the target language's index, one for all or one per sentence [B].
        max_positions: the decoder's position embeddings (``ModelConfig.max_len``).
        config: ``beam`` is ignored; ``lenpen`` only scales the reported scores.
        eos_id: the end-of-sentence id.
        banned_ids: ids never generated (pad, control tokens).
        keep_going: lockstep across ranks (module docstring).

    Returns:
        One hypothesis per sentence, in input order.
    """
    state = _start(scorer, src_BS, src_mask_BS, src_langs_B, tgt_tags, tgt_langs, keep_going)
    limit_R = max_lengths(state.src_lengths_B, config, max_positions)
    least_R = min_lengths(state.src_lengths_B, config)
    sentence_R = torch.arange(state.batch, device=state.device)
    prefix_RT = state.tags_B[:, None]
    langs_R = state.langs_B
    memory = state.memory
    cache = DecoderCache() if config.incremental else None
    sums_R = torch.zeros(state.batch, device=state.device)
    results: list[Hypothesis | None] = [None] * state.batch
    step = 0
    while _continue(sentence_R.numel() > 0, keep_going):
        if sentence_R.numel() == 0:
            state.dummy_step(scorer)
            continue
        logp_RV = _constrain(
            scorer.decode_step(prefix_RT, langs_R, memory, cache),
            step,
            least_R,
            limit_R,
            config,
            eos_id,
            banned_ids,
            prefix_RT,
        )
        best_R, token_R = logp_RV.max(dim=-1)
        sums_R = sums_R + best_R
        done_R = token_R == eos_id
        if bool(done_R.any()):
            for row in done_R.nonzero().flatten().tolist():
                log_prob = float(sums_R[row])
                results[int(sentence_R[row])] = Hypothesis(
                    prefix_RT[row, 1:].tolist(), _normalize(log_prob, step + 1, config), log_prob
                )
            keep = (~done_R).nonzero().flatten()
            prefix_RT, token_R, sums_R = prefix_RT[keep], token_R[keep], sums_R[keep]
            sentence_R, langs_R = sentence_R[keep], langs_R[keep]
            limit_R, least_R = limit_R[keep], least_R[keep]
            memory = _select(memory, keep)
            cache = cache.select(keep) if cache is not None else None
        prefix_RT = torch.cat([prefix_RT, token_R[:, None]], dim=1)
        step += 1
    return [_require(hyp) for hyp in results]


@torch.no_grad()  # not inference_mode: ZeRO-3 re-partitions parameters inside forward calls
def beam_search(
    scorer: Seq2SeqScorer,
    src_BS: torch.Tensor,
    src_mask_BS: torch.Tensor,
    src_langs_B: torch.Tensor,
    *,
    tgt_tags: int | torch.Tensor,
    tgt_langs: int | torch.Tensor,
    max_positions: int,
    config: SearchConfig = SearchConfig(beam=5),
    eos_id: int = EOS_ID,
    banned_ids: Sequence[int] = (),
    keep_going: KeepGoing | None = None,
) -> list[Hypothesis]:
    """Beam search with ``config.beam`` hypotheses per sentence, all sentences batched.

    Each step scores the K live hypotheses of every unfinished sentence in one call (B*K
    rows) and takes the 2K best extensions per sentence: an extension by ``</s>`` among the
    first K is finished, the K best others live on. A sentence stops when it has K finished
    hypotheses that its live ones cannot beat (see ``SearchConfig.exact_stop``) or at its
    maximum length; its rows then leave the batch. Arguments as :func:`greedy_search`.

    Returns:
        The best finished hypothesis of each sentence, in input order.
    """
    beam = config.beam
    state = _start(scorer, src_BS, src_mask_BS, src_langs_B, tgt_tags, tgt_langs, keep_going)
    device = state.device
    limit_B = max_lengths(state.src_lengths_B, config, max_positions)
    least_B = min_lengths(state.src_lengths_B, config)
    sentence_B = torch.arange(state.batch, device=device)
    expand_R = sentence_B.repeat_interleave(beam)
    prefix_RT = state.tags_B[expand_R][:, None]
    langs_R = state.langs_B[expand_R]
    memory = _select(state.memory, expand_R) if state.batch else state.memory
    cache = DecoderCache() if config.incremental else None
    # All K rows of a sentence start equal: only the first may extend at step 0, so that the
    # first K candidates are K different tokens.
    sums_BK = torch.zeros(state.batch, beam, device=device)
    sums_BK[:, 1:] = -math.inf
    finished: list[list[Hypothesis]] = [[] for _ in range(state.batch)]
    step = 0
    while _continue(sentence_B.numel() > 0, keep_going):
        if sentence_B.numel() == 0:
            state.dummy_step(scorer)
            continue
        count = sentence_B.numel()
        logp_RV = _constrain(
            scorer.decode_step(prefix_RT, langs_R, memory, cache),
            step,
            least_B.repeat_interleave(beam),
            limit_B.repeat_interleave(beam),
            config,
            eos_id,
            banned_ids,
            prefix_RT,
        )
        vocab = logp_RV.shape[-1]
        candidates_BC = (sums_BK.reshape(-1, 1) + logp_RV).view(count, beam * vocab)
        values_BC, index_BC = candidates_BC.topk(min(2 * beam, beam * vocab), dim=-1)
        source_BC = index_BC // vocab
        token_BC = index_BC % vocab
        is_eos_BC = token_BC == eos_id
        rank_C = torch.arange(values_BC.shape[1], device=device)

        # Finished: an end among the K best candidates (fairseq's rule, which makes beam 1
        # greedy search).
        final_BC = is_eos_BC & (rank_C < beam) & torch.isfinite(values_BC)
        for b, c in final_BC.nonzero().tolist():
            row = b * beam + int(source_BC[b, c])
            log_prob = float(values_BC[b, c])
            finished[int(sentence_B[b])].append(
                Hypothesis(
                    prefix_RT[row, 1:].tolist(), _normalize(log_prob, step + 1, config), log_prob
                )
            )

        # Live: the K best candidates that do not end (at most K of the 2K end: one per row).
        order_BK = (rank_C + is_eos_BC * values_BC.shape[1]).argsort(dim=-1)[:, :beam]
        sums_BK = values_BC.gather(1, order_BK)
        rows_R = (
            (torch.arange(count, device=device)[:, None] * beam)
            .add(source_BC.gather(1, order_BK))
            .flatten()
        )
        prefix_RT = torch.cat([prefix_RT[rows_R], token_BC.gather(1, order_BK).view(-1, 1)], 1)
        cache = cache.select(rows_R) if cache is not None else None

        keep = [
            b
            for b, (sentence, best_live, limit) in enumerate(
                zip(sentence_B.tolist(), sums_BK[:, 0].tolist(), limit_B.tolist(), strict=True)
            )
            if not _sentence_done(finished[sentence], best_live, step, limit, config)
        ]
        if len(keep) < count:
            keep_B = torch.tensor(keep, dtype=torch.long, device=device)
            keep_R = (keep_B[:, None] * beam + torch.arange(beam, device=device)).flatten()
            sentence_B, limit_B, sums_BK = sentence_B[keep_B], limit_B[keep_B], sums_BK[keep_B]
            least_B = least_B[keep_B]
            prefix_RT, langs_R = prefix_RT[keep_R], langs_R[keep_R]
            memory = _select(memory, keep_R)
            cache = cache.select(keep_R) if cache is not None else None
        step += 1
    return [_best(hyps) for hyps in finished]


# --------------------------------------------------------------------------------------------
# Shared steps


@dataclasses.dataclass
class _Start:
    batch: int
    device: torch.device
    """The model's: where every tensor of the search lives."""
    src_lengths_B: torch.Tensor
    """Real source tokens of each sentence (its ``</s>`` included)."""
    memory: EncoderOutput
    tags_B: torch.Tensor
    langs_B: torch.Tensor
    dummy_memory: EncoderOutput | None
    dummy_prefix: torch.Tensor
    dummy_lang: torch.Tensor

    def dummy_step(self, scorer: Seq2SeqScorer) -> None:
        """A one-row step whose result is ignored, so this rank's collectives match."""
        assert self.dummy_memory is not None  # made whenever keep_going is given
        scorer.decode_step(self.dummy_prefix, self.dummy_lang, self.dummy_memory)


def _start(
    scorer: Seq2SeqScorer,
    src_BS: torch.Tensor,
    src_mask_BS: torch.Tensor,
    src_langs_B: torch.Tensor,
    tgt_tags: int | torch.Tensor,
    tgt_langs: int | torch.Tensor,
    keep_going: KeepGoing | None,
) -> _Start:
    """Checks the inputs, moves them to the model's device and encodes the batch (a dummy row
    when it is empty in lockstep)."""
    if src_BS.dim() != 2 or src_mask_BS.shape != src_BS.shape:
        raise ValueError(
            f"src_BS and src_mask_BS must be [B, S] alike, got {tuple(src_BS.shape)} and "
            f"{tuple(src_mask_BS.shape)}"
        )
    batch, device = src_BS.shape[0], scorer_device(scorer, src_BS.device)
    src_BS, src_mask_BS, src_langs_B = (
        t.to(device, non_blocking=True) for t in (src_BS, src_mask_BS, src_langs_B)
    )
    if src_langs_B.shape != (batch,):
        raise ValueError(f"src_langs_B must be [{batch}], got {tuple(src_langs_B.shape)}")
    if batch and not bool(src_mask_BS.any(dim=1).all()):
        raise ValueError("every source needs at least one real token (its </s>)")
    tags_B = _per_sentence(tgt_tags, batch, device, "tgt_tags")
    langs_B = _per_sentence(tgt_langs, batch, device, "tgt_langs")
    dummy_src = torch.full((1, 1), EOS_ID, dtype=torch.long, device=device)
    dummy_lang = torch.zeros(1, dtype=torch.long, device=device)
    if batch:
        memory = scorer.encode(src_BS, src_mask_BS.bool(), src_langs_B)
        dummy_memory = _select(memory, torch.zeros(1, dtype=torch.long, device=device))
    elif keep_going is not None:
        memory = scorer.encode(dummy_src, torch.ones_like(dummy_src, dtype=torch.bool), dummy_lang)
        dummy_memory = memory
    else:
        empty = torch.zeros(0, 0, 0, device=device)
        memory = EncoderOutput(empty, empty, torch.zeros(0, 0, dtype=torch.bool, device=device))
        dummy_memory = None
    lengths_B = src_mask_BS.sum(1)
    return _Start(
        batch, device, lengths_B, memory, tags_B, langs_B, dummy_memory, dummy_src, dummy_lang
    )


def scorer_device(scorer: Seq2SeqScorer, default: torch.device) -> torch.device:
    """Where ``scorer`` computes: its ``device`` attribute, else its first parameter's device
    (an ``nn.Module``), else ``default`` (a scorer with neither, e.g. a test double)."""
    device = getattr(scorer, "device", None)
    if device is not None:
        return torch.device(device)
    parameters = getattr(scorer, "parameters", None)
    if callable(parameters):
        for parameter in parameters():
            return parameter.device
    return torch.device(default)


def _per_sentence(
    value: int | torch.Tensor, batch: int, device: torch.device, name: str
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.shape != (batch,):
            raise ValueError(f"{name} must be an int or a [{batch}] tensor, got {value.shape}")
        return value.to(device=device, dtype=torch.long)
    return torch.full((batch,), int(value), dtype=torch.long, device=device)


def _continue(local_unfinished: bool, keep_going: KeepGoing | None) -> bool:
    """One step more? Asks every rank through ``keep_going`` when it is given."""
    if keep_going is None:
        return local_unfinished
    anyone = keep_going(local_unfinished)
    if local_unfinished and not anyone:
        raise RuntimeError(
            "keep_going answered False while this rank still had unfinished rows; it must "
            "return whether ANY rank has them (e.g. an all-reduce MAX of the flag)"
        )
    return anyone


def _constrain(
    logp_RV: torch.Tensor,
    step: int,
    least_R: torch.Tensor,
    limit_R: torch.Tensor,
    config: SearchConfig,
    eos_id: int,
    banned_ids: Sequence[int],
    prefix_RT: torch.Tensor,
) -> torch.Tensor:
    """Applies the banned ids, repeated n-grams, the minimum length and the forced end (which
    wins). ``prefix_RT``: each row's language tag and the tokens generated so far."""
    logp_RV = logp_RV.float()
    # The forced </s> keeps its real log-probability (even before the minimum length), so
    # forced endings rank fairly.
    eos_R = logp_RV[:, eos_id].clone()
    if banned_ids:
        banned = torch.tensor(list(banned_ids), dtype=torch.long, device=logp_RV.device)
        logp_RV = logp_RV.index_fill(1, banned, -math.inf)
    if config.no_repeat_ngram:
        logp_RV = _block_repeated_ngrams(logp_RV, prefix_RT[:, 1:], config.no_repeat_ngram)
    if config.min_len or config.min_len_a:  # no per-step comparison without a minimum
        early_R = least_R > step
        if bool(early_R.any()):
            logp_RV = logp_RV.clone()
            logp_RV[:, eos_id] = torch.where(early_R, -math.inf, logp_RV[:, eos_id])
    forced_R = limit_R <= step
    if bool(forced_R.any()):
        only_eos = torch.full_like(logp_RV, -math.inf)
        only_eos[:, eos_id] = eos_R
        logp_RV = torch.where(forced_R[:, None], only_eos, logp_RV)
    return logp_RV


def _block_repeated_ngrams(logp_RV: torch.Tensor, tokens_RL: torch.Tensor, n: int) -> torch.Tensor:
    """-inf for each token that would complete an n-gram its row already holds: every earlier
    n-gram whose first n - 1 tokens equal the row's last n - 1 bans its last token. All rows
    at once, no Python loop over hypotheses."""
    length = tokens_RL.shape[1]
    if length < n:
        return logp_RV
    windows_RWN = tokens_RL.unfold(1, n, 1)
    last_RN = tokens_RL[:, length - (n - 1) :]
    match_RW = (windows_RWN[:, :, : n - 1] == last_RN[:, None, :]).all(dim=-1)
    rows, cols = match_RW.nonzero(as_tuple=True)
    blocked = logp_RV.clone()
    blocked[rows, windows_RWN[rows, cols, n - 1]] = -math.inf
    return blocked


def _normalize(log_prob: float, length: int, config: SearchConfig) -> float:
    return log_prob / length**config.lenpen


def _sentence_done(
    finished: list[Hypothesis], best_live: float, step: int, limit: int, config: SearchConfig
) -> bool:
    if step >= limit:
        return True
    if len(finished) < config.beam:
        return False
    if best_live == -math.inf:
        return True
    kth_best = sorted((h.score for h in finished), reverse=True)[config.beam - 1]
    # The live hypotheses hold step + 1 tokens. Their log-probability can only fall, so for
    # lenpen <= 0 their score if they ended now bounds anything they can reach; for lenpen > 0
    # a longer ending divides by more, and the exact bound is at the maximum length.
    length = limit + 1 if config.exact_stop and config.lenpen > 0 else step + 1
    return kth_best >= _normalize(best_live, length, config)


def _select(memory: EncoderOutput, index: torch.Tensor) -> EncoderOutput:
    """The rows ``index`` of every tensor of the encoder output."""
    return dataclasses.replace(
        memory,
        **{
            field.name: getattr(memory, field.name).index_select(0, index)
            for field in dataclasses.fields(memory)
        },
    )


def _best(hypotheses: list[Hypothesis]) -> Hypothesis:
    if not hypotheses:
        # Only when every token is banned or -inf: no path has a finite score.
        return Hypothesis([], -math.inf, -math.inf)
    return max(hypotheses, key=lambda h: h.score)


def _require(hypothesis: Hypothesis | None) -> Hypothesis:
    assert hypothesis is not None  # every row ends by its forced </s>
    return hypothesis
