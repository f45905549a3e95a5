"""Translation pairs stored as one token sequence, and splitting batches of them.

The shard builder's parallel mode stores each pair as ``source ids + [separator] + target
ids``, with the tokenizer's eos id as separator (SentencePiece encoding never produces it,
so the first one is the split). A pair is then an ordinary sentence of the shards: packing,
the loader, token-budget batching, data-parallel splitting and exact resume all work
unchanged, and no step can split a pair. The trainer splits loader batches back into source
and target with :func:`split_pairs`.

Cropping: the loader crops sentences to ``LoaderConfig.max_len``, which for a pair would cut
off the end of the target. ``ShardLoader`` therefore refuses a ``max_len`` below the longest
pair a pair entry may hold (``PairLayout.max_length``, 2 x the build's ``max_tokens`` + 1).

Shape suffixes: B batch rows, T padded pair length, S padded source length, U padded target
length.
"""

from __future__ import annotations

import torch

__all__ = ["split_pairs"]


def split_pairs(
    tokens_BT: torch.Tensor, lengths_B: torch.Tensor, separator_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits padded pair sequences at their first separator, without a loop over rows.

    Args:
        tokens_BT: [B, T] pair sequences, left-aligned and padded (a loader batch).
        lengths_B: [B] real length of each row (separator included).
        separator_id: the id between source and target (``PairLayout.separator_id``).
        pad_id: the id that fills the outputs past each row's length.

    Returns:
        ``(src_BS, src_len_B, tgt_BU, tgt_len_B)``: sources and targets, each left-aligned,
        padded with ``pad_id`` to its longest row, with their lengths; same device and
        dtype as the input.

    Raises:
        ValueError: a row has no separator within its length (not a pair, or a pair cropped
            before its separator); the message lists the rows.
    """
    if tokens_BT.ndim != 2 or lengths_B.shape != tokens_BT.shape[:1]:
        raise ValueError(
            f"expected tokens [B, T] and lengths [B], got {tuple(tokens_BT.shape)} and "
            f"{tuple(lengths_B.shape)}"
        )
    batch, width = tokens_BT.shape
    device = tokens_BT.device
    lengths_B = lengths_B.to(device=device, dtype=torch.long)
    if batch and not bool(((lengths_B >= 0) & (lengths_B <= width)).all()):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths_B.tolist()[:10]}")
    columns_T = torch.arange(width, device=device)
    is_sep_BT = (tokens_BT == separator_id) & (columns_T < lengths_B[:, None])
    has_sep_B = is_sep_BT.any(dim=1)
    if not bool(has_sep_B.all()):
        rows = torch.nonzero(~has_sep_B).flatten().tolist()
        raise ValueError(
            f"rows {rows[:10]}{' ...' if len(rows) > 10 else ''} of the batch hold no "
            f"separator id {separator_id}: they are not pairs from a parallel shard entry, "
            "or were cropped (set LoaderConfig.max_len to the pair entry's max_length)"
        )
    # argmax returns the first maximal position: the first separator of each row.
    src_len_B = is_sep_BT.to(torch.uint8).argmax(dim=1)
    tgt_len_B = lengths_B - src_len_B - 1
    src_width = int(src_len_B.max()) if batch else 0
    tgt_width = int(tgt_len_B.max()) if batch else 0

    src_BS = tokens_BT[:, :src_width]
    src_BS = src_BS.masked_fill(columns_T[:src_width] >= src_len_B[:, None], pad_id)

    columns_U = columns_T[:tgt_width]
    gather_BU = (src_len_B[:, None] + 1 + columns_U).clamp(max=max(width - 1, 0))
    tgt_BU = tokens_BT.gather(1, gather_BU)
    tgt_BU = tgt_BU.masked_fill(columns_U >= tgt_len_B[:, None], pad_id)
    return src_BS, src_len_B, tgt_BU, tgt_len_B
