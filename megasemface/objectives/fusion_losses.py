"""Deep fusion's intermediate losses and the negatives of its contrastive one.

- Target words prediction (TWP, Eq. 15-16): from the mean-pooled last part of the
  coordinator's aggregation, predict the bag of words of the target sentence, each word
  independent: ``-log prod_j softmax(logits)[y_j]`` over the set of the target's words,
  averaged over the words of the batch's bags (a sum per sentence would grow with the
  sentence and outweigh the other losses at a weight of 1).
- Target sentence prediction (TSP, Eq. 17): a contrastive loss between the projected pooled
  source ``g(x)`` and target ``g(y)`` representations, with cosine similarity; the
  negatives are the batch's other targets and synthetic ones, made from targets by picking
  half their words and swapping, replacing or deleting each (:func:`corrupt_sentences`).

Shapes: B batch, K synthetic negatives, T length, D model size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megasemface.objectives.noising import pack_left, random_ranks, real_token_mask

__all__ = ["bag_of_words_loss", "contrastive_loss", "corrupt_sentences"]


def bag_of_words_loss(
    logits_BV: torch.Tensor,
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    ignore_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Eq. 15: mean over the batch's bag words of ``-log softmax(logits_b)[word]``, each
    row's bag the set of its real tokens less ``ignore_ids``; fp32."""
    batch, vocab = logits_BV.shape
    real = real_token_mask(lengths_B, tokens_BT.shape[1])
    bag_BV = torch.zeros(batch, vocab, dtype=torch.bool, device=logits_BV.device)
    rows = torch.arange(batch, device=tokens_BT.device)[:, None].expand_as(tokens_BT)
    bag_BV[rows[real], tokens_BT[real]] = True  # a set: repeated words count once
    if ignore_ids:
        bag_BV[:, [i for i in ignore_ids if 0 <= i < vocab]] = False
    log_probs = torch.log_softmax(logits_BV.float(), dim=-1)
    return -(log_probs * bag_BV).sum() / bag_BV.sum().clamp(min=1)


def contrastive_loss(
    source_BD: torch.Tensor,
    target_BD: torch.Tensor,
    negative_KD: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 17: ``-log exp(s(g(x_i), g(y_i))) / sum_c exp(s(g(x_i), c))`` over the candidates
    ``c``: every target of the batch (``y_i`` and the in-batch negatives) and the ``K``
    synthetic negatives; ``s`` the cosine similarity over ``temperature`` (1 in the paper).
    Returns the batch's mean loss and the share of sources whose own target scores highest
    (detached)."""
    candidates = torch.cat([target_BD, negative_KD]).float()
    similarity = F.normalize(source_BD.float(), dim=-1) @ F.normalize(candidates, dim=-1).T
    logits_BC = similarity / temperature
    labels = torch.arange(source_BD.shape[0], device=source_BD.device)
    loss = F.cross_entropy(logits_BC, labels)
    accuracy = (logits_BC.argmax(-1) == labels).float().mean().detach()
    return loss, accuracy


def corrupt_sentences(
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    generator: torch.Generator,
    *,
    vocab_size: int,
    special_ids: Sequence[int],
    pad_id: int,
    share: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TSP's synthetic negatives: in each row, ``round(share x length)`` words (at least one)
    chosen at random, each then swapped, replaced or deleted with equal chance. Swapped words
    trade places among themselves at random; a replacement is a uniform non-special word;
    deleted words close up. The words stay the target's, their order and meaning do not.

    Returns ``(tokens [B, T], lengths [B])`` on the input's device (made on the host: the
    generator is the step's CPU one)."""
    device = tokens_BT.device
    tokens, lengths = tokens_BT.cpu(), lengths_B.cpu()
    batch, width = tokens.shape
    real = real_token_mask(lengths, width)
    count = torch.round(lengths.double() * share).long().clamp(min=1)
    chosen = (random_ranks(real, generator) < count[:, None]) & real
    action = torch.randint(3, (batch, width), generator=generator)
    swap, replace, delete = (chosen & (action == a) for a in range(3))

    out = tokens.clone()
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special_ids if 0 <= i < vocab_size]] = False
    candidates = allowed.nonzero().squeeze(1)
    picks = torch.randint(candidates.numel(), (int(replace.sum()),), generator=generator)
    out[replace] = candidates[picks].to(out.dtype)

    # Swap: the swap positions of a row in order, and the same positions in random order;
    # the j-th in order takes the word of the j-th in random order.
    position = torch.arange(width).expand(batch, width).double()
    in_order = torch.argsort(torch.where(swap, position, width + position), dim=1)
    noise = torch.rand(batch, width, generator=generator, dtype=torch.float64)
    shuffled = torch.argsort(torch.where(swap, noise, 2.0 + position), dim=1)
    first = torch.arange(width)[None, :] < swap.sum(1, keepdim=True)
    rows = torch.arange(batch)[:, None].expand(batch, width)
    swapped = out.clone()
    swapped[rows[first], in_order[first]] = out[rows[first], shuffled[first]]

    packed, new_lengths = pack_left(swapped, real & ~delete, pad_id=pad_id, width=width)
    return packed.to(device), new_lengths.to(device)
