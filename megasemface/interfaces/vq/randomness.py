"""Counter-based randomness of the VQ layer: Gumbel noise and initial weights that do not
depend on how the layer is split.

Gumbel noise is a pure function of (key, token index, global code index), computed by a
counter-based hash (SplitMix64) rather than a stateful generator: every model-parallel rank
draws exactly the noise the unsplit layer would draw for its codes, whatever the split or the
token chunking, and backward regenerates it instead of storing it. Initial weights are drawn
per block of global rows from generators seeded by the layer's seed, so a split layer starts
from exactly the shard of the unsplit layer's weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megasemface.interfaces.vq.noise_kernel import noise_from_hashes

__all__ = [
    "TAG_CODEBOOK",
    "TAG_HIDDEN_B",
    "TAG_HIDDEN_W",
    "TAG_LOGITS_B",
    "TAG_LOGITS_W",
    "TAG_NOISE",
    "gumbel_noise",
    "gumbel_of_hashes",
    "init_rows",
    "mix_key",
    "noise_hashes",
]

_INIT_BLOCK_ROWS = 1024
"""Initial weights are drawn per block of this many global rows (split-independent)."""

_NOISE_ELEMENTS = 1 << 20
"""Noise is hashed in column blocks of about this many elements: cache-sized int64 temporaries
(a performance knob only; the values do not depend on it)."""


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


def _fmix64(z: int) -> int:
    """SplitMix64's finaliser on Python ints (reference for the tensor version)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return z ^ (z >> 31)


def mix_key(*parts: int) -> int:
    """Hashes non-negative integers to a 64-bit key; stable across processes and runs."""
    h = 0
    for part in parts:
        h = _fmix64((h + _GOLDEN) ^ (part & _M64))
    return h


def _fmix64_(z: Tensor, *, high_bits_only: bool = False) -> Tensor:
    """In-place SplitMix64 finaliser on an int64 tensor with wrap-around multiplication.

    torch's ``>>`` on int64 is arithmetic, so the logical shift is an arithmetic one followed
    by a mask of the low 64 - s bits. ``high_bits_only`` leaves out the last xor-shift,
    which changes only the low 33 bits (``z >> 31`` has none above bit 32): bits 33 to 63 are
    final without it, and the noise reads only its top 23.
    """
    rounds = (
        ((30, _MUL1), (27, _MUL2)) if high_bits_only else ((30, _MUL1), (27, _MUL2), (31, None))
    )
    for shift, mul in rounds:
        z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(_signed(mul))
    return z


def gumbel_noise(
    key: int,
    token_start: int,
    num_tokens: int,
    code_start: int,
    num_codes: int,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Gumbel(0, 1) noise [num_tokens, num_codes] (fp32) for a block of (token, code) indices.

    Element (t, c) depends only on ``key`` and the absolute indices, so any tiling of the
    (token, code) plane, by chunks, by model-parallel shards or both, reproduces the same
    values. Token t's row seed is SplitMix64 output t of a stream seeded by ``key``; element c
    is output c of the stream seeded by the row seed. The top 23 bits of the hash give
    ``u = (b + 0.5) / 2**23``, strictly inside (0, 1) in fp32, so ``-log(-log(u))`` is finite
    (the tails are cut at about -2.8 and 16.6, probability 6e-8).
    """
    device = torch.device(device)
    out = torch.empty(num_tokens, num_codes, dtype=torch.float32, device=device)
    if num_tokens == 0 or num_codes == 0:
        return out
    tokens = range(token_start, token_start + num_tokens)
    rows, cols = noise_hashes(key, tokens, range(code_start, code_start + num_codes), device)
    if device.type == "cuda":
        fused = noise_from_hashes(rows, cols)
        if fused is not None:
            return fused
    step = max(64, _noise_elements(device) // num_tokens)
    for c0 in range(0, num_codes, step):
        c1 = min(num_codes, c0 + step)
        out[:, c0:c1] = gumbel_of_hashes(rows[:, None] + cols[None, c0:c1])
    return out


def gumbel_of_hashes(z: Tensor) -> Tensor:
    """Gumbel noise (fp32) of the hash inputs ``z`` (int64: row seed plus scaled code
    index, see :func:`noise_hashes`), of any shape; overwrites ``z``. SplitMix64's
    finaliser, its top 23 bits as ``u``, and ``-log(-log(u))``."""
    z = _fmix64_(z, high_bits_only=True)
    z.bitwise_right_shift_(41).bitwise_and_((1 << 23) - 1)
    u = z.to(torch.float32).add_(0.5).mul_(2.0**-23)
    return u.log_().neg_().log_().neg_()


def noise_hashes(
    key: int, tokens: range, codes: range, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """The row seeds [len(tokens)] and scaled code indices [len(codes)] (int64 holding
    uint64 bits) whose sums :func:`gumbel_noise` hashes: element (t, c) is ``fmix(rows[t] +
    cols[c])``."""
    rows = torch.arange(tokens.start + 1, tokens.stop + 1, device=device)
    rows = _fmix64_(rows.mul_(_signed(_GOLDEN)).add_(_signed(key)))
    cols = torch.arange(codes.start + 1, codes.stop + 1, device=device)
    return rows, cols.mul_(_signed(_GOLDEN))


def _noise_elements(device: torch.device) -> int:
    """Elements per eager noise block: cache-sized on a CPU, few kernel launches on a GPU."""
    return _NOISE_ELEMENTS if device.type == "cpu" else _NOISE_ELEMENTS << 6


def init_rows(
    seed: int, tag: int, start: int, stop: int, cols: int, kind: str, scale: float
) -> Tensor:
    """Rows ``[start, stop)`` of a global [rows, cols] fp32 init, drawn per fixed row block.

    Each block of ``_INIT_BLOCK_ROWS`` global rows comes from its own generator, always drawn in
    full, so a shard gets exactly the unsplit table's rows without materialising the table.
    """
    pieces = []
    first, last = start // _INIT_BLOCK_ROWS, (stop - 1) // _INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        gen = torch.Generator().manual_seed(mix_key(seed, tag, block) >> 1)
        b0 = block * _INIT_BLOCK_ROWS
        values = torch.empty(_INIT_BLOCK_ROWS, cols)
        if kind == "normal":
            values.normal_(0.0, scale, generator=gen)
        else:
            values.uniform_(-scale, scale, generator=gen)
        pieces.append(values[max(start, b0) - b0 : min(stop, b0 + _INIT_BLOCK_ROWS) - b0])
    return torch.cat(pieces) if pieces else torch.empty(0, cols)


TAG_HIDDEN_W, TAG_HIDDEN_B, TAG_LOGITS_W, TAG_LOGITS_B, TAG_CODEBOOK = range(5)
TAG_NOISE = 100
