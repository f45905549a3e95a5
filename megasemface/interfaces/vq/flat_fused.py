"""The flat layer's passes over a chunk's [tokens, codes] logits as fused Triton kernels.

Eagerly, each chunk of :class:`~megasemface.interfaces.vq.flat.FlatQuantize` makes about
twenty passes through [chunk, Kl] fp32 buffers (bias, noise, maxima, exponentials, sums,
products): on an H100 at the paper's 102,400 codes those passes, not the matrix products,
took three quarters of the joint step's device time. Here forward reads the product's
logits twice: once for each token's maxima, first arg-maxima and partition sums (an online
softmax, whose sums are rescaled to the global maxima after the model-parallel max), once
for the column sums of the diversity distribution. Backward reads the logits and the
straight-through product twice: once for two dot products per token, once to write the
logits' gradient (in the products' dtype) and its column sums. The bias is added and the
Gumbel noise hashed in registers each time (:mod:`megasemface.interfaces.vq.noise_kernel`);
no [chunk, Kl] temporary is written besides the products' outputs and the gradient. Each
thread keeps its own running maxima and sums and combines them with the others' once, at
the end of its row or column, rather than after every block.

The values are the eager passes' up to float rounding (the online rescaling, the order of
the sums, the logarithms' last bit). Sums run in a fixed order, with no atomics, so a run
repeats itself bit for bit. Used on a GPU where Triton is installed
(``VQConfig.fused_kernels``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from megasemface.interfaces.vq.noise_kernel import triton

if triton is not None:
    import triton.language as tl

    from megasemface.interfaces.vq.noise_kernel import gumbel_from_hashes

__all__ = [
    "Chunk",
    "available",
    "column_sums",
    "first_build",
    "grad_logits",
    "row_dots",
    "row_stats",
]

_ROW_BLOCK = 1024
"""Codes a row program reads at a time (row statistics and dot products)."""
_TILE_ROWS, _TILE_COLS = 32, 128
"""Tokens x codes of a column program's tile (column sums and the logits' gradient)."""


_failed: list[str] = []
"""Why the kernels did not build in this process, once they failed to."""
_built: set[str] = set()
"""The directions ("forward", "backward") whose kernels have run in this process."""

T = TypeVar("T")


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device``: a GPU with Triton installed, where
    they have not failed to build."""
    return triton is not None and device.type == "cuda" and not _failed


def first_build(direction: str, call: Callable[..., T], *args: Any) -> T | None:
    """``call(*args)``, whose kernels Triton builds on their first run in this process. Where
    that first run fails (a GPU or a Triton they do not support), says so once and returns
    None: the caller runs the eager passes, and :func:`available` is False from then on. A
    failure after a first run that succeeded is an error of its own and is raised."""
    if direction in _built:
        return call(*args)
    try:
        result = call(*args)
    except Exception as exc:
        _failed.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
        warnings.warn(
            f"the VQ layer's fused kernels did not build ({_failed[0]}); running its eager "
            "passes instead (--model vq.fused_kernels=false does so without trying)",
            stacklevel=2,
        )
        return None
    _built.add(direction)
    return result


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A chunk's logit product and what rebuilds its scores from it."""

    product: Tensor
    """[n, Kl] fp32: the logits without the bias."""
    bias: Tensor
    """[Kl] fp32."""
    seeds: Tensor
    """[n] int64: the noise's row seeds (``randomness.noise_hashes``)."""
    cols: Tensor
    """[Kl] int64: the noise's scaled code indices."""
    tau: float
    sample: bool
    """Whether the scores carry Gumbel noise (training) or are the logits themselves."""
    from_gumbel: bool
    """Whether the diversity loss averages Eq. 5's probabilities or softmax(l)."""


if triton is not None:

    @triton.jit
    def _scores(lg, seed, col, SAMPLE: tl.constexpr):  # type: ignore[no-untyped-def]
        """Selection scores s = l + v (training) or l itself."""
        if SAMPLE:
            return lg + gumbel_from_hashes(seed, col)
        return lg

    @triton.jit
    def _columns(bias_ptr, cols_ptr, n_cols, TILE_COLS: tl.constexpr):  # type: ignore[no-untyped-def]
        """A column program's codes, their mask, bias and scaled indices."""
        offs_k = tl.program_id(0) * TILE_COLS + tl.arange(0, TILE_COLS)
        k_in = offs_k < n_cols
        bias = tl.load(bias_ptr + offs_k, mask=k_in, other=0.0)
        col = tl.load(cols_ptr + offs_k, mask=k_in, other=0).to(tl.uint64, bitcast=True)
        return offs_k, k_in, bias, col

    @triton.jit
    def _tile(  # type: ignore[no-untyped-def]
        logits_ptr, bias, offs_k, k_in, r0, n_rows, n_cols, TILE_ROWS: tl.constexpr
    ):  # fmt: skip
        """Rows r0.. of a column program: their indices, masks, offsets and logits."""
        offs_m = r0 + tl.arange(0, TILE_ROWS)
        m_in = offs_m < n_rows
        inside = m_in[:, None] & k_in[None, :]
        at = offs_m.to(tl.int64)[:, None] * n_cols + offs_k[None, :]
        lg = tl.load(logits_ptr + at, mask=inside, other=0.0) + bias[None, :]
        return offs_m, m_in, inside, at, lg

    @triton.jit
    def _tile_q(lg, seeds_ptr, col, stats_ptr, offs_m, m_in, inv_tau, SAMPLE: tl.constexpr):  # type: ignore[no-untyped-def]
        """A tile's normalised Eq. 5 probabilities, from the global max and sum of s."""
        seed = tl.load(seeds_ptr + offs_m, mask=m_in, other=0).to(tl.uint64, bitcast=True)
        s = _scores(lg, seed[:, None], col[None, :], SAMPLE)
        top = tl.load(stats_ptr + 5 * offs_m, mask=m_in, other=0.0)
        total = tl.load(stats_ptr + 5 * offs_m + 2, mask=m_in, other=1.0)
        return tl.exp((s - top[:, None]) * inv_tau) / total[:, None]

    @triton.jit
    def _tile_r(lg, stats_ptr, offs_m, m_in):  # type: ignore[no-untyped-def]
        """A tile's centred logits l - max l and softmax(l)."""
        top = tl.load(stats_ptr + 5 * offs_m + 1, mask=m_in, other=0.0)
        total = tl.load(stats_ptr + 5 * offs_m + 3, mask=m_in, other=1.0)
        centred = lg - top[:, None]
        return centred, tl.exp(centred) / total[:, None]

    @triton.jit
    def _row_stats_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, bias_ptr, seeds_ptr, cols_ptr, maxes_ptr, index_ptr, sums_ptr,
        n_cols, inv_tau, SAMPLE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * n_cols
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        lanes = tl.arange(0, BLOCK)
        # Per thread: the running maxima of s and l, the first index attaining each, and
        # the sums relative to those maxima (Eq. 5's partition sum, softmax(l)'s, and
        # sum e^(l-m) (l-m) for the entropy). One exponential per element and sum: of the
        # element and the running maximum, the smaller one is shifted down.
        m_s = tl.full([BLOCK], -float("inf"), tl.float32)
        m_l = tl.full([BLOCK], -float("inf"), tl.float32)
        i_s = tl.zeros([BLOCK], tl.int32)
        i_l = tl.zeros([BLOCK], tl.int32)
        q_sum = tl.zeros([BLOCK], tl.float32)
        p_sum = tl.zeros([BLOCK], tl.float32)
        t_sum = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            offs = c0 + lanes
            inside = offs < n_cols
            lg = tl.load(base + offs, mask=inside, other=0.0)
            lg += tl.load(bias_ptr + offs, mask=inside, other=0.0)
            col = tl.load(cols_ptr + offs, mask=inside, other=0).to(tl.uint64, bitcast=True)
            s = _scores(lg, seed, col, SAMPLE)
            up = inside & (s > m_s)
            e = tl.exp(-tl.abs(s - m_s) * inv_tau)
            q_sum = tl.where(up, q_sum * e + 1.0, tl.where(inside, q_sum + e, q_sum))
            i_s = tl.where(up, offs, i_s)
            m_s = tl.where(up, s, m_s)
            up = inside & (lg > m_l)
            d = -tl.abs(lg - m_l)
            e = tl.exp(d)
            grown = e * (t_sum + tl.where(p_sum > 0.0, p_sum * d, 0.0))
            t_sum = tl.where(up, grown, tl.where(inside, t_sum + e * d, t_sum))
            p_sum = tl.where(up, p_sum * e + 1.0, tl.where(inside, p_sum + e, p_sum))
            i_l = tl.where(up, offs, i_l)
            m_l = tl.where(up, lg, m_l)
        # The threads combined: among those holding the maximum, the smallest first index.
        top_s = tl.max(m_s, 0)
        top_l = tl.max(m_l, 0)
        first_s = tl.min(tl.where(m_s == top_s, i_s, n_cols), 0)
        first_l = tl.min(tl.where(m_l == top_l, i_l, n_cols), 0)
        q_all = tl.sum(tl.where(q_sum > 0.0, q_sum * tl.exp((m_s - top_s) * inv_tau), 0.0), 0)
        shift = m_l - top_l
        scale = tl.exp(shift)
        p_all = tl.sum(tl.where(p_sum > 0.0, p_sum * scale, 0.0), 0)
        t_all = tl.sum(tl.where(p_sum > 0.0, (t_sum + p_sum * shift) * scale, 0.0), 0)
        tl.store(maxes_ptr + 2 * row, top_s)
        tl.store(maxes_ptr + 2 * row + 1, top_l)
        tl.store(index_ptr + 2 * row, first_s.to(tl.int64))
        tl.store(index_ptr + 2 * row + 1, first_l.to(tl.int64))
        tl.store(sums_ptr + 3 * row, q_all)
        tl.store(sums_ptr + 3 * row + 1, p_all)
        tl.store(sums_ptr + 3 * row + 2, t_all)

    @triton.jit
    def _column_sums_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, bias_ptr, seeds_ptr, cols_ptr, stats_ptr, psum_ptr, n_rows, n_cols,
        inv_tau, FROM_GUMBEL: tl.constexpr, SAMPLE: tl.constexpr,
        TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr,
    ):  # fmt: skip
        offs_k, k_in, bias, col = _columns(bias_ptr, cols_ptr, n_cols, TILE_COLS)
        acc = tl.zeros([TILE_ROWS, TILE_COLS], dtype=tl.float32)
        for r0 in range(0, n_rows, TILE_ROWS):
            offs_m, m_in, inside, _, lg = _tile(
                logits_ptr, bias, offs_k, k_in, r0, n_rows, n_cols, TILE_ROWS
            )
            if FROM_GUMBEL:
                p = _tile_q(lg, seeds_ptr, col, stats_ptr, offs_m, m_in, inv_tau, SAMPLE)
            else:
                p = _tile_r(lg, stats_ptr, offs_m, m_in)[1]
            acc += tl.where(inside, p, 0.0)
        old = tl.load(psum_ptr + offs_k, mask=k_in, other=0.0)
        tl.store(psum_ptr + offs_k, old + tl.sum(acc, 0), mask=k_in)

    @triton.jit
    def _row_dots_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, bias_ptr, seeds_ptr, cols_ptr, stats_ptr, gsoft_ptr, gdiv_ptr, dots_ptr,
        n_cols, inv_tau, SAMPLE: tl.constexpr, HAS_GQ: tl.constexpr,
        DIV_SOFT: tl.constexpr, DIV_PLAIN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        offset = row.to(tl.int64) * n_cols
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        top_s = tl.load(stats_ptr + 5 * row)
        top_l = tl.load(stats_ptr + 5 * row + 1)
        total_s = tl.load(stats_ptr + 5 * row + 2)
        total_l = tl.load(stats_ptr + 5 * row + 3)
        dot_q = tl.zeros([BLOCK], tl.float32)
        dot_r = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            inside = offs < n_cols
            lg = tl.load(logits_ptr + offset + offs, mask=inside, other=0.0)
            lg += tl.load(bias_ptr + offs, mask=inside, other=0.0)
            if DIV_SOFT or DIV_PLAIN:
                g_div = tl.load(gdiv_ptr + offs, mask=inside, other=0.0)
            if HAS_GQ or DIV_SOFT:
                col = tl.load(cols_ptr + offs, mask=inside, other=0).to(tl.uint64, bitcast=True)
                q = tl.exp((_scores(lg, seed, col, SAMPLE) - top_s) * inv_tau) / total_s
                g_q = tl.zeros([BLOCK], dtype=tl.float32)
                if HAS_GQ:
                    g_q += tl.load(gsoft_ptr + offset + offs, mask=inside, other=0.0)
                if DIV_SOFT:
                    g_q += g_div
                dot_q += tl.where(inside, q * g_q, 0.0)
            if DIV_PLAIN:
                r = tl.exp(lg - top_l) / total_l
                dot_r += tl.where(inside, r * g_div, 0.0)
        tl.store(dots_ptr + 2 * row, tl.sum(dot_q, 0))
        tl.store(dots_ptr + 2 * row + 1, tl.sum(dot_r, 0))

    @triton.jit
    def _grad_logits_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, bias_ptr, seeds_ptr, cols_ptr, stats_ptr, gsoft_ptr, gdiv_ptr, dots_ptr,
        gent_ptr, out_ptr, gbias_ptr, n_rows, n_cols, inv_tau, SAMPLE: tl.constexpr,
        HAS_GQ: tl.constexpr, SOFT_USED: tl.constexpr, DIV_SOFT: tl.constexpr,
        DIV_PLAIN: tl.constexpr, HAS_ENT: tl.constexpr, NEED_BIAS: tl.constexpr,
        TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr,
    ):  # fmt: skip
        offs_k, k_in, bias, col = _columns(bias_ptr, cols_ptr, n_cols, TILE_COLS)
        if DIV_SOFT or DIV_PLAIN:
            g_div = tl.load(gdiv_ptr + offs_k, mask=k_in, other=0.0)
        if HAS_ENT:
            g_ent = tl.load(gent_ptr)
        acc = tl.zeros([TILE_ROWS, TILE_COLS], dtype=tl.float32)
        for r0 in range(0, n_rows, TILE_ROWS):
            offs_m, m_in, inside, at, lg = _tile(
                logits_ptr, bias, offs_k, k_in, r0, n_rows, n_cols, TILE_ROWS
            )
            grad = tl.zeros([TILE_ROWS, TILE_COLS], dtype=tl.float32)
            if SOFT_USED:
                q = _tile_q(lg, seeds_ptr, col, stats_ptr, offs_m, m_in, inv_tau, SAMPLE)
                g_q = tl.zeros([TILE_ROWS, TILE_COLS], dtype=tl.float32)
                if HAS_GQ:
                    g_q += tl.load(gsoft_ptr + at, mask=inside, other=0.0)
                if DIV_SOFT:
                    g_q += g_div[None, :]
                dot = tl.load(dots_ptr + 2 * offs_m, mask=m_in, other=0.0)
                grad = (g_q - dot[:, None]) * q * inv_tau
            if DIV_PLAIN or HAS_ENT:
                centred, r = _tile_r(lg, stats_ptr, offs_m, m_in)
                if DIV_PLAIN:
                    dot = tl.load(dots_ptr + 2 * offs_m + 1, mask=m_in, other=0.0)
                    grad += (g_div[None, :] - dot[:, None]) * r
                if HAS_ENT:
                    mean = tl.load(stats_ptr + 5 * offs_m + 4, mask=m_in, other=0.0)
                    grad -= r * (centred - mean[:, None]) * g_ent
            grad = tl.where(inside, grad, 0.0)
            tl.store(out_ptr + at, grad.to(out_ptr.dtype.element_ty), mask=inside)
            if NEED_BIAS:
                acc += grad
        if NEED_BIAS:
            old = tl.load(gbias_ptr + offs_k, mask=k_in, other=0.0)
            tl.store(gbias_ptr + offs_k, old + tl.sum(acc, 0), mask=k_in)


def row_stats(chunk: Chunk) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: the local maxima [n, 2] of s (Eq. 5's scores) and of l, the first local
    indices attaining them [n, 2], and the sums [n, 3] ``sum exp((s - m_s) / tau)``,
    ``sum exp(l - m_l)`` and ``sum exp(l - m_l) (l - m_l)`` relative to those maxima."""
    n, k = chunk.product.shape
    device = chunk.product.device
    maxes = torch.empty(n, 2, dtype=torch.float32, device=device)
    index = torch.empty(n, 2, dtype=torch.int64, device=device)
    sums = torch.empty(n, 3, dtype=torch.float32, device=device)
    if n:
        _row_stats_kernel[(n,)](
            chunk.product, chunk.bias, chunk.seeds, chunk.cols, maxes, index, sums, k,
            1.0 / chunk.tau, SAMPLE=chunk.sample, BLOCK=_ROW_BLOCK,
        )  # fmt: skip
    return maxes, index, sums


def column_sums(chunk: Chunk, stats: Tensor, psum: Tensor) -> None:
    """Adds to ``psum`` [Kl] the column sums of the chunk's diversity distribution, Eq. 5's
    probabilities or softmax(l), normalised by the global ``stats`` [n, 5] (max s, max l,
    their partition sums, the entropy's mean)."""
    n, k = chunk.product.shape
    _column_sums_kernel[(triton.cdiv(k, _TILE_COLS),)](
        chunk.product, chunk.bias, chunk.seeds, chunk.cols, stats, psum, n, k, 1.0 / chunk.tau,
        FROM_GUMBEL=chunk.from_gumbel, SAMPLE=chunk.sample, TILE_ROWS=_TILE_ROWS,
        TILE_COLS=_TILE_COLS,
    )  # fmt: skip


def row_dots(
    chunk: Chunk, stats: Tensor, grad_soft: Tensor | None, grad_div: Tensor | None
) -> Tensor:
    """Per token, the local parts [n, 2] of ``<q, gq>`` (gq: the straight-through product
    ``grad_soft`` plus, from Eq. 5's probabilities, the diversity gradient ``grad_div``) and
    of ``<r, grad_div>`` for softmax(l) r; see ``flat._flat_logit_backward``."""
    n, k = chunk.product.shape
    dots = torch.zeros(n, 2, dtype=torch.float32, device=chunk.product.device)
    if n:
        _row_dots_kernel[(n,)](
            chunk.product, chunk.bias, chunk.seeds, chunk.cols, stats,
            _or(grad_soft, chunk.product), _or(grad_div, chunk.bias), dots, k, 1.0 / chunk.tau,
            SAMPLE=chunk.sample, HAS_GQ=grad_soft is not None,
            DIV_SOFT=chunk.from_gumbel and grad_div is not None,
            DIV_PLAIN=not chunk.from_gumbel and grad_div is not None, BLOCK=_ROW_BLOCK,
        )  # fmt: skip
    return dots


def grad_logits(
    chunk: Chunk,
    stats: Tensor,
    grad_soft: Tensor | None,
    grad_div: Tensor | None,
    dots: Tensor,
    grad_entropy: Tensor | None,
    grad_bias: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """The logits' gradient [n, Kl] in ``dtype`` from the global ``dots`` (the sums of
    :func:`row_dots` over the model-parallel group) and the entropies' upstream gradient
    ``grad_entropy`` (0-dim); adds its column sums to ``grad_bias``."""
    n, k = chunk.product.shape
    out = torch.empty(n, k, dtype=dtype, device=chunk.product.device)
    div_soft = chunk.from_gumbel and grad_div is not None
    _grad_logits_kernel[(triton.cdiv(k, _TILE_COLS),)](
        chunk.product, chunk.bias, chunk.seeds, chunk.cols, stats,
        _or(grad_soft, chunk.product), _or(grad_div, chunk.bias), dots,
        _or(grad_entropy, chunk.bias), out, _or(grad_bias, chunk.bias), n, k, 1.0 / chunk.tau,
        SAMPLE=chunk.sample, HAS_GQ=grad_soft is not None,
        SOFT_USED=grad_soft is not None or div_soft, DIV_SOFT=div_soft,
        DIV_PLAIN=not chunk.from_gumbel and grad_div is not None,
        HAS_ENT=grad_entropy is not None, NEED_BIAS=grad_bias is not None,
        TILE_ROWS=_TILE_ROWS, TILE_COLS=_TILE_COLS,
    )  # fmt: skip
    return out


def _or(tensor: Tensor | None, stand_in: Tensor) -> Tensor:
    """A kernel argument that its flags leave unread: any tensor on the right device."""
    return stand_in if tensor is None else tensor
