"""The VQ layer's Gumbel noise as one Triton kernel on a GPU.

:func:`megasemface.interfaces.vq.randomness.gumbel_noise` hashes every (token, code) pair with
SplitMix64. Eagerly that is about 20 passes over [tokens, codes] int64 temporaries, which
on a GPU at the paper's 102,400 codes took half the joint step; this kernel computes each
value in registers and writes it once. The hashing is exact integer arithmetic (uint64,
wrapping multiplication, logical shifts), so the values are those of the eager blocks up to
the last bit of the two logarithms. Without Triton the eager blocks serve.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager blocks serve
    triton = None

__all__ = ["gumbel_from_hashes", "noise_from_hashes"]

_BLOCK = 1024
_failed: list[str] = []


if triton is not None:

    @triton.jit
    def gumbel_from_hashes(seed, col):  # type: ignore[no-untyped-def]
        """Gumbel noise of the row seeds ``seed`` and scaled code indices ``col`` (uint64,
        broadcastable): SplitMix64's finaliser, the top 23 bits, two logarithms."""
        z = seed + col
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        bits = ((z >> 41) & 0x7FFFFF).to(tl.float32)
        u = (bits + 0.5) * 1.1920928955078125e-07  # 2**-23
        return -tl.log(-tl.log(u))

    @triton.jit
    def _noise_kernel(rows_ptr, cols_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n_cols
        seed = tl.load(rows_ptr + row).to(tl.uint64, bitcast=True)
        col = tl.load(cols_ptr + offsets, mask=inside, other=0).to(tl.uint64, bitcast=True)
        out = gumbel_from_hashes(seed, col)
        tl.store(out_ptr + row.to(tl.int64) * n_cols + offsets, out, mask=inside)


def noise_from_hashes(rows: Tensor, cols: Tensor) -> Tensor | None:
    """Gumbel noise [len(rows), len(cols)] fp32 from the row seeds ``rows`` and the scaled code
    indices ``cols`` (int64, on a GPU), or None where the kernel is not available."""
    if triton is None or _failed or not rows.is_cuda:
        return None
    out = torch.empty(rows.shape[0], cols.shape[0], dtype=torch.float32, device=rows.device)
    grid = (rows.shape[0], triton.cdiv(cols.shape[0], _BLOCK))
    try:
        _noise_kernel[grid](rows, cols, out, cols.shape[0], BLOCK=_BLOCK)
    except Exception as exc:  # a Triton that cannot build for this GPU: a speed loss only
        _failed.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            f"the Gumbel noise kernel did not build ({_failed[0]}); computing it eagerly",
            stacklevel=2,
        )
        return None
    return out
