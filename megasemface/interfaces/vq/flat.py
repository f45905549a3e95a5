"""The flat codebook's Gumbel-softmax, shard-local, chunked and recomputed in backward.

The table of K codes and the logit layer are split over the model-parallel group in
contiguous shards; :class:`FlatQuantize` computes everything shard-locally, on the pattern of
Megatron's vocab-parallel cross entropy: the only collectives are all-reduces of a few
scalars per token (maxima, partition sums, the smallest index among maxima). The [n, Kl]
logits exist for one chunk of tokens at a time, in forward and again in backward, except
where a call's buffers are small (``VQConfig.keep_logits_mib``): forward then keeps them for
backward, which would otherwise recompute the same values, the noise included. The layer
that uses it, and the notation, are in :mod:`megasemface.interfaces.vq.gumbel_quantizer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megasemface.distributed.groups import ParallelGroups, all_reduce_model_parallel
from megasemface.interfaces.vq import flat_fused as fused
from megasemface.interfaces.vq import flat_passes as passes
from megasemface.interfaces.vq.randomness import gumbel_noise, noise_hashes
from megasemface.nn import kernels

__all__ = ["FlatQuantize", "FlatSpec", "owned_codes"]


@dataclasses.dataclass(frozen=True, eq=False)
class FlatSpec:
    """Non-tensor arguments of :class:`FlatQuantize`."""

    groups: ParallelGroups
    code_offset: int
    num_codes: int
    chunk_tokens: int
    keep_bytes: int
    """Forward keeps its softmax buffers for backward when their three [N, Kl] fp32 buffers
    take at most this many bytes (else backward recomputes them)."""
    temperature: float
    sample: bool
    noise_key: int
    from_gumbel: bool
    need_soft: bool
    """Whether Eq. 5's probabilities are needed (straight-through gradient or diversity)."""
    out_dtype: torch.dtype
    matmul_dtype: torch.dtype = torch.float32
    """The operands' dtype of the layer's matrix products, whose results are fp32 either way:
    fp32, or on a GPU the weights' bf16/fp16 (tensor cores, fp32 accumulation), as autocast
    would multiply them; see :func:`matmul_dtype`."""
    distance_scale: float = 0.0
    """Positive: distance logits (``VQConfig.logits``) with this factor s, ``l = -s ||h -
    z||^2`` up to a per-token constant, i.e. ``(2 s h) z^T - s ||z||^2``: the logit weights
    are the codebook itself (``weight`` and ``bias`` are None), and its gradient comes back
    as one tensor. No [Kl, d] copy of the table is made (``2 s z`` and its gradient would
    be: at the paper's 102,400 x 1,024, each a 420 MB pass through memory)."""
    fused: bool = False
    """Each chunk's passes over its logits as the fused kernels of
    :mod:`~megasemface.interfaces.vq.flat_fused` where they run (a GPU with Triton); forward
    then keeps no buffers for backward, whose recomputation costs one product and two fused
    passes. Elsewhere, the eager passes compiled where :attr:`compiled` says."""
    compiled: bool = False
    """The eager passes (:mod:`~megasemface.interfaces.vq.flat_passes`) compiled by the
    process's :func:`~megasemface.nn.kernels.run_pass`: set by :class:`FlatQuantize` from
    ``fused`` where the fused kernels do not run and the installed passes compile chunks
    of this size."""


def matmul_dtype(weight: Tensor) -> torch.dtype:
    """bf16/fp16 for such weights on a GPU, whose products accumulate in fp32 into fp32
    results (``torch.mm(..., out_dtype=torch.float32)``, CUDA only); else fp32, so that CPU
    runs multiply fp32 operands as before. Half operands hold the same values as the
    weights: only the accumulation order of the products differs from an fp32 product."""
    half = weight.dtype in (torch.bfloat16, torch.float16)
    return weight.dtype if half and weight.device.type == "cuda" else torch.float32


def _mm(x: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """``x @ y`` in fp32, from operands of ``dtype`` (see :func:`matmul_dtype`)."""
    if dtype == torch.float32:
        return kernels.mm(x.float(), y.float())
    return torch.mm(x.to(dtype), y.to(dtype), out_dtype=torch.float32)


def _logit_operands(
    a: Tensor, weight: Tensor | None, bias: Tensor | None, codebook: Tensor, spec: FlatSpec
) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, wm, b32)`` with the local logits ``l = x wm^T + b32``: ``wm`` in
    ``spec.matmul_dtype`` and detached, ``b32`` fp32. Distance logits fold 2 s into the
    [N, d] input rather than into the [Kl, d] table, and take the codes' squared norms in
    one reduction (fp32 accumulation, no [Kl, d] temporary)."""
    if spec.distance_scale:
        norms = torch.linalg.vector_norm(codebook.detach(), dim=-1, dtype=torch.float32)
        b32 = norms.square_().mul_(-spec.distance_scale)
        return _logit_input(a, spec), codebook.detach().to(spec.matmul_dtype), b32
    assert weight is not None and bias is not None
    return a, weight.detach().to(spec.matmul_dtype), bias.detach().float()


def _logit_input(a: Tensor, spec: FlatSpec) -> Tensor:
    """The left operand of the logits' product: ``2 s a`` in fp32 for distance logits."""
    return a.float() * (2.0 * spec.distance_scale) if spec.distance_scale else a


def _chunk_logits(
    a: Tensor, wm: Tensor, b32: Tensor, spec: FlatSpec, t0: int
) -> tuple[Tensor, Tensor]:
    """Local logits l [n, Kl] and selection scores s = l + v (training) or l itself (eval).
    ``wm``: the logit weights in ``spec.matmul_dtype``."""
    if spec.matmul_dtype == torch.float32:
        logits = kernels.linear(a.float(), wm, b32)  # the bias added in the product's pass
    else:
        logits = _mm(a, wm.t(), spec.matmul_dtype).add_(b32)
    if not spec.sample:
        return logits, logits
    n_tok, n_local = a.shape[0], wm.shape[0]
    if spec.compiled:  # hashed and added in one pass, no int64 [n, Kl] temporaries
        codes = range(spec.code_offset, spec.code_offset + n_local)
        rows, cols = noise_hashes(spec.noise_key, range(t0, t0 + n_tok), codes, a.device)
        return logits, kernels.run_pass(passes.noisy_scores, True, logits, rows, cols)
    noise = gumbel_noise(spec.noise_key, t0, n_tok, spec.code_offset, n_local, device=a.device)
    return logits, noise.add_(logits)


class FlatQuantize(torch.autograd.Function):
    """Shard-local Gumbel-softmax quantisation of all N tokens, chunk by chunk.

    Inputs: ``a`` [N, H] (ReLU output, already through copy_to_model_parallel), the local
    ``weight`` [Kl, H], ``bias`` [Kl] and ``codebook`` [Kl, d]; for distance logits
    (``spec.distance_scale``) ``a`` is the hidden state [N, d] and ``weight`` and ``bias``
    are None. Outputs: this rank's part of the output [N, d] (the chosen rows it owns, zeros
    elsewhere; summed over mp by the caller), the local column sums [Kl] of the diversity
    distribution (differentiable), the codes [N] and the noise-free argmax codes [N] (the
    same as the codes when not sampling).

    Saved for backward: the inputs (the bias in fp32) and 5 scalars per token (codes, the two
    global maxima, the two partition sums); per chunk, backward recomputes the logits and the
    noise. Peak transient memory is a few [chunk, Kl] fp32 buffers in forward and in backward.
    Where ``spec.keep_bytes`` allows, forward saves each chunk's three buffers too (three
    [N, Kl] in all) and backward reads them (in place: a second backward through the same
    graph is refused by autograd's version check).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        a: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        codebook: Tensor,
        spec: FlatSpec,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        groups, tau = spec.groups, spec.temperature
        n_tok, n_local = a.shape[0], codebook.shape[0]
        device = a.device
        if spec.fused and not fused.available(device):
            elements = min(n_tok, spec.chunk_tokens) * n_local
            compiled = kernels.compiled_passes(elements, device)
            spec = dataclasses.replace(spec, fused=False, compiled=compiled)
        codes = torch.empty(n_tok, dtype=torch.int64, device=device)
        greedy = torch.empty(n_tok, dtype=torch.int64, device=device)
        # Per token: global max of s, global max of l, sum exp for Eq. 5, sum exp for softmax(l),
        # and the mean of l - max(l) under softmax(l) (for the token's entropy).
        stats = torch.zeros(n_tok, 5, dtype=torch.float32, device=device)
        psum = torch.zeros(n_local, dtype=torch.float32, device=device)
        needs_logit_grad = any(ctx.needs_input_grad[:3]) or (
            spec.distance_scale > 0 and ctx.needs_input_grad[3]
        )
        keep = needs_logit_grad and 3 * 4 * n_tok * n_local <= spec.keep_bytes and not spec.fused
        kept: list[Tensor] = []
        with torch.autocast(device.type, enabled=False):
            x, wm, b32 = _logit_operands(a, weight, bias, codebook, spec)
            if spec.fused:
                codes_here = range(spec.code_offset, spec.code_offset + n_local)
                hashes = noise_hashes(spec.noise_key, range(n_tok), codes_here, device)
            for t0 in range(0, n_tok, spec.chunk_tokens):
                t1 = min(n_tok, t0 + spec.chunk_tokens)
                if spec.fused:
                    chosen = fused.first_build(
                        "forward", _fused_chunk, x[t0:t1], wm, b32, hashes, t0, stats[t0:t1],
                        psum, spec,
                    )  # fmt: skip
                    if chosen is not None:
                        codes[t0:t1], greedy[t0:t1] = chosen[:, 0], chosen[:, 1]
                        continue
                    spec = dataclasses.replace(spec, fused=False)  # they did not build here
                logits, scores = _chunk_logits(x[t0:t1], wm, b32, spec, t0)
                # Local maxima and the first (smallest) local index attaining them, of the
                # scores and (when sampling) of the noise-free logits.
                local_max, local_idx = scores.max(dim=1)
                plain_max, plain_idx = logits.max(dim=1) if spec.sample else (local_max, local_idx)
                maxes, chosen = _global_codes(
                    torch.stack([local_max, plain_max], dim=1),
                    torch.stack([local_idx, plain_idx], dim=1),
                    spec,
                )
                codes[t0:t1], greedy[t0:t1] = chosen[:, 0], chosen[:, 1]
                # fl(max(s) / tau) == max(fl(s / tau)): rounding is monotone.
                soft, centered, plain, sums = kernels.run_pass(
                    passes.exponentials, spec.compiled, scores, logits, maxes, tau,
                    spec.sample, spec.need_soft,
                )  # fmt: skip
                all_reduce_model_parallel(sums, groups, "sum")
                stats[t0:t1, :2] = maxes
                stats[t0:t1, 2:4] = sums[:, :2]
                stats[t0:t1, 4] = sums[:, 2] / sums[:, 1]
                if spec.from_gumbel:
                    assert soft is not None
                    psum.addmv_(soft.t(), sums[:, 0].reciprocal())
                else:
                    psum.addmv_(plain.t(), sums[:, 1].reciprocal())
                if keep:  # backward would recompute exactly these (unnormalised) values
                    kept += (centered, plain) if soft is None else (centered, plain, soft)
                del logits, scores, soft, plain, centered
        # H(softmax(l)) per token = log S - E[l - max]; identical on every model-parallel rank.
        entropy_sum = (stats[:, 3].log() - stats[:, 4]).sum()
        # Masks rather than boolean indexing, which would wait for the device to count.
        owned, local = owned_codes(codes, spec.code_offset, n_local)
        quantized = codebook[local].to(spec.out_dtype).masked_fill(~owned[:, None], 0.0)
        ctx.spec = spec
        ctx.bias_dtype = None if bias is None else bias.dtype
        # Detached: under ZeRO-3 the parameters' .data is released after the forward; the
        # detached tensors keep the gathered values that backward recomputes the logits from.
        ctx.save_for_backward(
            a,
            None if weight is None else weight.detach(),
            b32,
            codebook.detach(),
            codes,
            stats,
            *kept,
        )
        ctx.mark_non_differentiable(codes, greedy)
        ctx.set_materialize_grads(False)  # an unused output costs no backward work
        return quantized, psum, codes, greedy, entropy_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_quantized: Tensor | None,
        grad_psum: Tensor | None,
        _grad_codes: Any,
        _grad_greedy: Any,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        spec: FlatSpec = ctx.spec
        a, weight, b32, codebook, codes, stats, *kept = ctx.saved_tensors
        need_a, need_w, need_b, need_c = ctx.needs_input_grad[:4]
        s = spec.distance_scale
        if s:  # the logit weights are the codebook
            need_w = need_b = need_c
        n_local = codebook.shape[0]
        grad_a = grad_w = grad_b = grad_c = None
        with torch.autocast(a.device.type, enabled=False):
            if need_a or need_w or need_b:
                wm = (codebook if s else weight).to(spec.matmul_dtype)
                grad_a, grad_w, grad_b = _flat_logit_backward(
                    _logit_input(a, spec),
                    wm,
                    b32,
                    codebook,
                    stats,
                    grad_quantized,
                    grad_psum,
                    grad_entropy,
                    spec,
                    (need_a, need_w, need_b),
                    tuple(kept),
                )
                if s:
                    # d l / d h = 2 s z and d l_k / d z_k = 2 s h - 2 s z_k: the table's
                    # gradient from the logits is 2 s (G^T h - colsum(G) z) for the logits'
                    # gradient G, already 2 s G^T h in grad_w.
                    if grad_a is not None:
                        grad_a = grad_a.mul_(2.0 * s).to(a.dtype)
                    if grad_w is not None:
                        assert grad_b is not None
                        grad_c = grad_w.addcmul_(codebook, grad_b[:, None], value=-2.0 * s)
                    grad_w = grad_b = None
                else:
                    assert weight is not None
                    grad_w = None if grad_w is None else grad_w.to(weight.dtype)
                    grad_b = None if grad_b is None else grad_b.to(ctx.bias_dtype)
            if need_c and grad_quantized is not None:
                # Straight-through: d out / d codebook is the forward value of the weights,
                # i.e. the one-hot, so only the chosen rows receive the output gradient.
                owned, local = owned_codes(codes, spec.code_offset, n_local)
                if grad_c is None:
                    grad_c = torch.zeros(codebook.shape, dtype=torch.float32, device=a.device)
                rows = grad_quantized.float().masked_fill(~owned[:, None], 0.0)
                grad_c.index_add_(0, local, rows)
            if grad_c is not None:
                grad_c = grad_c.to(codebook.dtype)
        return grad_a, grad_w, grad_b, grad_c, None


def owned_codes(codes: Tensor, offset: int, n_local: int) -> tuple[Tensor, Tensor]:
    """Mask of codes held by this shard and their local indices (clamped where not owned)."""
    local = codes - offset
    owned = (local >= 0) & (local < n_local)
    return owned, local.clamp(0, n_local - 1)


def _global_codes(local_max: Tensor, local_idx: Tensor, spec: FlatSpec) -> tuple[Tensor, Tensor]:
    """The global maxima [n, 2] of the scores and of the noise-free logits, from this rank's
    local maxima and the first local indices attaining them [n, 2], and the smallest global
    index attaining each: among ranks holding a global maximum the smallest index, so ties
    resolve exactly as torch.argmax does on the unsplit logits."""
    maxes = all_reduce_model_parallel(local_max.clone(), spec.groups, "max")
    no_code = torch.full_like(local_idx, spec.num_codes)
    chosen = torch.where(local_max == maxes, local_idx, no_code)
    chosen.add_(spec.code_offset).clamp_(max=spec.num_codes)
    all_reduce_model_parallel(chosen, spec.groups, "min")
    # NaN logits leave no candidate; keep the index valid, the NaN reaches the loss.
    return maxes, chosen.clamp_(max=spec.num_codes - 1)


def _fused_chunk(
    x: Tensor,
    wm: Tensor,
    b32: Tensor,
    hashes: tuple[Tensor, Tensor],
    t0: int,
    stats: Tensor,
    psum: Tensor,
    spec: FlatSpec,
) -> Tensor:
    """Forward of one chunk through the fused kernels: fills the chunk's ``stats`` [n, 5],
    adds its diversity column sums to ``psum``; returns the codes and noise-free codes [n, 2]."""
    tau = spec.temperature
    chunk = _fused_chunk_of(x, wm, b32, hashes, t0, spec)
    local_max, local_idx, sums = fused.row_stats(chunk)
    maxes, chosen = _global_codes(local_max, local_idx, spec)
    # The sums are relative to this rank's maxima: rescale them to the global ones before
    # summing over ranks; sum e^(l-m)(l-m) also gains sum e^(l-m) times the shift.
    shift = local_max - maxes
    scale = torch.exp(torch.stack([shift[:, 0] / tau, shift[:, 1]], dim=1))
    sums[:, 2].add_(sums[:, 1] * shift[:, 1]).mul_(scale[:, 1])
    sums[:, :2].mul_(scale)
    all_reduce_model_parallel(sums, spec.groups, "sum")
    stats[:, :2] = maxes
    stats[:, 2:4] = sums[:, :2]
    stats[:, 4] = sums[:, 2] / sums[:, 1]
    fused.column_sums(chunk, stats, psum)
    return chosen


def _fused_chunk_of(
    x: Tensor, wm: Tensor, b32: Tensor, hashes: tuple[Tensor, Tensor], t0: int, spec: FlatSpec
) -> fused.Chunk:
    """The logit product of the chunk of tokens ``x`` starting at ``t0`` for the kernels."""
    seeds = hashes[0][t0 : t0 + x.shape[0]]
    product = _mm(x, wm.t(), spec.matmul_dtype)
    return fused.Chunk(
        product, b32, seeds, hashes[1], spec.temperature, spec.sample, spec.from_gumbel
    )


def _flat_logit_backward(
    a: Tensor,
    wm: Tensor,
    b32: Tensor,
    codebook: Tensor,
    stats: Tensor,
    grad_quantized: Tensor | None,
    grad_psum: Tensor | None,
    grad_entropy: Tensor | None,
    spec: FlatSpec,
    needs: tuple[bool, bool, bool],
    kept: Sequence[Tensor] = (),
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of the local logits ``l = a wm^T + b32``, chunk by chunk, then of ``a`` (in
    its dtype), ``wm`` and ``b32`` (fp32).

    With q = softmax(s / tau) (Eq. 5) and r = softmax(l), both over all K codes:
    dL/dl = q * (gq - <q, gq>) / tau + r * (gr - <r, gr>), where gq = grad_out @ codebook^T
    (straight-through: d out / d q_k = code k) plus the diversity gradient when it uses q, and
    gr the diversity gradient when it uses r; plus, for the summed token entropies
    H_t = -sum r log r with upstream gradient g, -g * r * (l - max - E_r[l - max]). The dot
    products run over all codes: one all-reduce of 2 scalars per token per chunk. ``needs``
    says which of the three gradients to compute (a frozen layer needs only ``a``'s). ``kept``:
    forward's unnormalised buffers of each chunk in turn (centred logits, their exponentials
    and, if computed, the Gumbel softmax), used in place instead of recomputed.
    """
    need_a, need_w, need_b = needs
    n_tok = a.shape[0]
    dtype = spec.matmul_dtype
    cm = codebook.to(dtype) if grad_quantized is not None else None
    g_div = grad_psum.float() if grad_psum is not None else None
    grad_a = torch.empty_like(a) if need_a else None
    grad_w: Tensor | None = None  # the first chunk's product, then accumulated (fp32)
    grad_b = torch.zeros(b32.shape, dtype=torch.float32, device=a.device) if need_b else None
    starts = range(0, n_tok, spec.chunk_tokens)
    per_chunk = len(kept) // max(1, len(starts))
    if spec.fused:
        codes_here = range(spec.code_offset, spec.code_offset + wm.shape[0])
        hashes = noise_hashes(spec.noise_key, range(n_tok), codes_here, a.device)
        g_div = None if g_div is None else g_div.contiguous()
        g_ent = None if grad_entropy is None else grad_entropy.float()
    product_dtype = dtype if grad_a is not None or need_w else torch.float32
    # The compiled passes also write the gradient transposed for the weight's product: the
    # installed product would otherwise copy the [n, Kl] gradient transposed itself, a
    # strided read that is slowest where the buffer starts on a page boundary (cache-set
    # conflicts).
    transposed = spec.compiled and need_w and dtype == torch.float32 and kernels.takes(a)
    for chunk, t0 in enumerate(starts):
        t1 = min(n_tok, t0 + spec.chunk_tokens)
        g_soft = None
        if cm is not None:
            assert grad_quantized is not None
            g_soft = _mm(grad_quantized[t0:t1], cm.t(), dtype)
        grad_logits = grad_logits_t = None
        if spec.fused:
            # The kernel adds the gradient's column sums to grad_b.
            grad_logits = fused.first_build(
                "backward", _fused_grad_logits, a[t0:t1], wm, b32, hashes, t0, stats[t0:t1],
                g_soft, g_div, g_ent, grad_b, product_dtype, spec,
            )  # fmt: skip
            if grad_logits is None:
                spec = dataclasses.replace(spec, fused=False)  # they did not build here
        if grad_logits is None:
            this = kept[chunk * per_chunk : (chunk + 1) * per_chunk]
            grad_logits, grad_logits_t = _eager_grad_logits(
                a[t0:t1], wm, b32, stats[t0:t1], g_soft, g_div, grad_entropy, this, spec, t0,
                grad_b, transposed,
            )  # fmt: skip
        del g_soft
        # The products' operands in the products' dtype, as autocast's backward multiplies.
        grad_logits_mm = grad_logits.to(product_dtype)
        if grad_a is not None:
            grad_a[t0:t1] = _mm(grad_logits_mm, wm, dtype).to(a.dtype)
        if need_w:  # no zero-filled [Kl, d] buffer to add the first product to
            if dtype == torch.float32 and kernels.takes(a):
                left = grad_logits.float().t() if grad_logits_t is None else grad_logits_t
                product = kernels.mm(left, a[t0:t1].float())
                grad_w = product if grad_w is None else grad_w.add_(product)
            elif dtype == torch.float32:
                if grad_w is None:
                    grad_w = grad_logits.float().t() @ a[t0:t1].float()
                else:
                    grad_w.addmm_(grad_logits.float().t(), a[t0:t1].float())
            else:
                product = _mm(grad_logits_mm.t(), a[t0:t1], dtype)
                grad_w = product if grad_w is None else grad_w.add_(product)
        del grad_logits, grad_logits_t, grad_logits_mm
    if need_w and grad_w is None:  # no tokens
        grad_w = torch.zeros(wm.shape, dtype=torch.float32, device=a.device)
    return grad_a, grad_w, grad_b


def _fused_grad_logits(
    a: Tensor,
    wm: Tensor,
    b32: Tensor,
    hashes: tuple[Tensor, Tensor],
    t0: int,
    stats: Tensor,
    g_soft: Tensor | None,
    g_div: Tensor | None,
    g_ent: Tensor | None,
    grad_b: Tensor | None,
    dtype: torch.dtype,
    spec: FlatSpec,
) -> Tensor:
    """One chunk's logits gradient in ``dtype`` through the fused kernels; adds its column
    sums to ``grad_b``."""
    chunk = _fused_chunk_of(a, wm, b32, hashes, t0, spec)
    dots = fused.row_dots(chunk, stats, g_soft, g_div)
    all_reduce_model_parallel(dots, spec.groups, "sum")
    return fused.grad_logits(chunk, stats, g_soft, g_div, dots, g_ent, grad_b, dtype)


def _eager_grad_logits(
    a: Tensor,
    wm: Tensor,
    b32: Tensor,
    st: Tensor,
    grad_soft: Tensor | None,
    g_div: Tensor | None,
    grad_entropy: Tensor | None,
    kept: Sequence[Tensor],
    spec: FlatSpec,
    t0: int,
    grad_b: Tensor | None,
    transposed: bool,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's logits gradient [n, Kl] (fp32) from its ``st`` [n, 5], the
    straight-through product ``grad_soft`` and forward's ``kept`` buffers, if any, else
    recomputing the logits and the noise (see :func:`_flat_logit_backward`), and when
    ``transposed`` the same [Kl, n]; adds its column sums to ``grad_b``."""
    soft_used = grad_soft is not None or (spec.from_gumbel and g_div is not None)
    plain_used = (not spec.from_gumbel and g_div is not None) or grad_entropy is not None
    if not soft_used and not plain_used:
        return torch.zeros(a.shape[0], wm.shape[0], device=a.device), None
    if kept:
        centered, plain = kept[0], kept[1]
        soft = kept[2] if soft_used else None
    else:
        logits, scores = _chunk_logits(a, wm, b32, spec, t0)
        soft, centered, plain, _ = kernels.run_pass(
            passes.exponentials, spec.compiled, scores, logits, st[:, :2], spec.temperature,
            spec.sample, soft_used,
        )  # fmt: skip
    if not plain_used:
        plain = centered = None
    dots, grad_soft = kernels.run_pass(
        passes.gradient_dots, spec.compiled, soft, plain, st, grad_soft, g_div, spec.from_gumbel
    )
    all_reduce_model_parallel(dots, spec.groups, "sum")
    grad_logits, grad_logits_t, column_sums = kernels.run_pass(
        passes.logits_gradient, spec.compiled, soft, plain, centered, st, grad_soft, g_div,
        dots, grad_entropy, spec.temperature, spec.from_gumbel, grad_b is not None, transposed,
    )  # fmt: skip
    if grad_b is not None:
        grad_b.add_(column_sums)
    return grad_logits, grad_logits_t
