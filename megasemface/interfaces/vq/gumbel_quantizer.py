"""The vector-quantised semantic interface of VQ-SemFace (paper section 2.3).

A hidden state ``h`` becomes code logits ``l``: minus its scaled squared distance to each code,
or through Linear(d, H) -> ReLU -> Linear(H, K) (see Logits below). In training a code is drawn
with the Gumbel-softmax (Eq. 5), ``p = softmax((l + v) / tau)`` with Gumbel noise ``v``; the
forward output is exactly the chosen code's vector (the argmax of ``p``) and the backward passes
the gradient to all of ``p`` (straight-through estimator). In evaluation the code is the argmax
of ``l``, without noise. The diversity loss acts on ``pbar``, the average code distribution over
the global batch, with ``H`` its entropy and ``exp(H)`` its perplexity
(``VQConfig.diversity_loss``):

* ``perplexity`` (the default, wav2vec 2.0's form): ``L_d = (K - exp(H)) / K``, 0 when every
  code is equally likely, near 1 when a few codes take all the mass. Its gradient with respect
  to ``H`` is ``-exp(H) / K``: about -1 while the codebook is in use, whatever K.
* ``eq6`` (the paper's Eq. 6 as printed): ``L_d = (1/K) sum_k pbar_k log pbar_k = -H / K``.
  Its gradient with respect to ``H`` is ``-1/K`` (1e-5 at K = 102,400), and the whole term
  moves by at most ``ln(K) / K``: too weak to keep a codebook from collapsing. Kept for the
  ablation that shows it.

Logits (``VQConfig.logits``). The paper states the code of ``h`` as the nearest neighbour
``argmin_k ||h - z_k||`` (Eq. 4), then computes it with the Linear-ReLU-Linear above, as
wav2vec 2.0 does (``mlp``). Those logits owe nothing to the codes' position, so ``h`` may lie
anywhere relative to its code; when the stages are
connected without the interface, the pre-trained decoder reads ``h`` in place of the codes
it was trained on. ``distance`` (the default) takes Eq. 4 literally: ``l_k = -s ||h -
z_k||^2`` (s = 1 / sqrt(w) for codes of width w up to ``vq.distance_width``, sqrt(that) / w
beyond: ``nn/code_distance.py``), so the noise-free code is the nearest one, the
straight-through gradient moves ``h`` towards the codes that lower the loss and away from
the others, and the layer has no weights but the codebook; validation chose it
(docs/pretraining.md). Both are the GEMM ``a W^T + b`` of the
flat kernel (for ``distance``: ``a = h``, ``W = 2 s z``, ``b = -s ||z||^2``; the flat kernel
multiplies ``2 s h`` by the table itself rather than making ``W``).

Code usage. What the model actually picks is the noise-free argmax (the code used at inference
and when stages are connected), so :class:`VQOutput` carries it in training too
(``greedy_codes``), and :class:`~megasemface.interfaces.vq.code_usage.CodeUsage` accumulates it
over a window of steps across all ranks: codes used, histogram perplexity, dead codes.

Two layouts (``VQConfig.layout``):

* ``flat``: one table of K codes of size d, e.g. the paper's 102,400 x 1024. The table and the
  second Linear are split over the model-parallel group in contiguous shards (rank r holds codes
  ``[r K/p, (r+1) K/p)``), and everything is computed shard-locally on the pattern of Megatron's
  vocab-parallel cross entropy: the only collectives are all-reduces of a few scalars per token
  (max, sum of exps, smallest index among maxima) and ONE all-reduce of the [N, d] output. The
  full [N, K] logits are never gathered, [N, K, d] is never formed (logits are a GEMM; the
  output is a row gather, its gradient a GEMM with the table), and the [n, K/p] logits exist only
  for one chunk of ``chunk_tokens`` tokens at a time, in forward and again (recomputed) in
  backward by :mod:`~megasemface.interfaces.vq.flat`, so activation memory is
  O(N (H + d) + chunk K/p) (below ``keep_logits_mib``, forward keeps them for backward).
* ``product`` (wav2vec 2.0): G tables of V entries of size d/G; logits G*V, a softmax per
  group, the output is the concatenation of the G chosen entries and the code id
  ``sum_g idx_g V**(G-g-1)``. Small (640 logits per token for 320 x 2), so it is replicated on
  model-parallel ranks and uses plain autograd.

Randomness. Gumbel noise is a pure function of (seed, step, call, dp rank, token index, global
code index), computed by a counter-based hash (SplitMix64) rather than a stateful generator:
every rank draws exactly the noise the unsplit layer would draw for its codes, whatever the
model-parallel split or the token chunking, and backward regenerates it instead of storing it.
Initial weights are generated per block of 1024 global rows from generators seeded by the
layer's seed, so a split layer starts from exactly the shard of the unsplit layer's weights
(:mod:`~megasemface.interfaces.vq.randomness`).

Diversity statistics. ``pbar`` averages over all real tokens of the global batch: the per-code
probability sums and the token count are summed over the data-parallel group (the probability
sums by :func:`global_batch_sum`, whose backward multiplies by dp_size so DeepSpeed's gradient
averaging yields the exact global gradient), and, for the flat layout, the per-shard entropy
terms are summed over the model-parallel group by :func:`reduce_from_model_parallel`. By default
``pbar`` averages the noise-free softmax ``softmax(l)`` (wav2vec 2.0's code and fairseq's
``prob_perplexity``); with ``diversity_from_gumbel`` it averages Eq. 5's Gumbel probabilities
(the paper's text: "pk is calculated by Eq.(5)"); in evaluation those are noise-free too.

Numerics. Logits, softmaxes and their gradients are fp32 whatever the autocast state and the
parameter dtype; the output is cast back to the input's dtype (a code vector is then exact).

Shape legend: N tokens (real, flattened, no padding), n tokens of one chunk, d model width,
H ``hidden_dim``, K ``num_codes``, p model-parallel size, Kl = K/p codes held by this rank,
G ``groups``, V ``entries``, dg = d/G.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megasemface.distributed.groups import (
    ParallelGroups,
    all_reduce_data_parallel,
    copy_to_model_parallel,
    global_batch_sum,
    mark_model_parallel_parameter,
    reduce_from_model_parallel,
)
from megasemface.interfaces.vq.code_usage import CodeUsage, count_codes, entropy_shortfall
from megasemface.interfaces.vq.flat import FlatQuantize, FlatSpec, matmul_dtype, owned_codes
from megasemface.interfaces.vq.randomness import (
    TAG_CODEBOOK,
    TAG_HIDDEN_B,
    TAG_HIDDEN_W,
    TAG_LOGITS_B,
    TAG_LOGITS_W,
    TAG_NOISE,
    gumbel_noise,
    init_rows,
    mix_key,
)
from megasemface.interfaces.vq.shards import (
    SPLIT_PARAMETERS,
    gather_codebook,
    gather_state_dicts,
    shard_state_dict,
    split_codebook,
)
from megasemface.nn.code_distance import distance_logit_weights, distance_scale
from megasemface.nn.config import VQConfig

__all__ = [
    "SPLIT_PARAMETERS",
    "GumbelVectorQuantizer",
    "VQOutput",
    "gather_codebook",
    "gather_state_dicts",
    "shard_state_dict",
    "split_codebook",
]


class VQOutput(NamedTuple):
    """What the VQ layer returns for N real tokens.

    A named tuple, not a dataclass: DeepSpeed ZeRO-3 attaches its pre-backward hooks (which
    gather the layer's weights again for backward) to the tensors of a module's output only
    when it can walk the output (tuples, lists, dicts).

    ``code_counts`` is the global-batch histogram (summed over data parallelism) of this rank's
    codes: its Kl-code shard for the flat layout, the G*V table entries (group-major) for the
    product layout. Perplexities follow fairseq: ``exp`` of the entropy of a global-batch
    distribution, summed over groups for the product layout (maximum G*V).
    """

    quantized: Tensor
    """[N, d] chosen code vectors (straight-through in training), the input's dtype."""
    codes: Tensor
    """[N] int64 global code ids (product: sum_g idx_g * V**(G-g-1))."""
    diversity_loss: Tensor
    """Scalar fp32, Eq. 6 over the global batch; differentiable. Product: mean over groups."""
    token_entropy: Tensor
    """Scalar fp32, the mean over the global batch's tokens of the entropy of each token's
    noise-free code distribution softmax(l); differentiable. High while every token spreads
    over many codes (then the argmax is decided by small differences); the confidence term
    lowers it."""
    code_perplexity: Tensor
    """Scalar, perplexity of the histogram of ``codes`` over the global batch (Gumbel-sampled
    in training; no gradient)."""
    prob_perplexity: Tensor
    """Scalar, perplexity of pbar, the distribution the diversity loss uses (no gradient)."""
    temperature: float
    """Gumbel-softmax temperature used."""
    codes_used: Tensor
    """Scalar, fraction of codes (product: table entries) in ``codes`` of this global batch."""
    code_counts: Tensor
    """[Kl] (flat) or [G*V] (product) int64 counts of ``codes`` over the global batch."""
    greedy_codes: Tensor
    """[N] int64 global ids of the noise-free argmax codes, the ones inference picks (equal
    to ``codes`` when nothing is sampled). Feed them to :class:`CodeUsage`."""

    def metrics(self) -> dict[str, Tensor | float]:
        """Detached scalars for logging about this call's batch, read only when a step logs.

        Code usage is not among them: one batch's sampled codes say little about the codes
        the model picks (the Gumbel noise spreads them); :class:`CodeUsage` measures that.
        """
        return {
            "vq_diversity_loss": self.diversity_loss.detach(),
            "vq_token_perplexity": self.token_entropy.detach().exp(),
            "vq_sampled_perplexity": self.code_perplexity.detach(),
            "vq_prob_perplexity": self.prob_perplexity.detach(),
            "vq_temperature": self.temperature,
        }


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


class GumbelVectorQuantizer(nn.Module):
    """Gumbel-softmax vector quantiser with a flat (model-parallel) or product codebook.

    ``forward(h)`` takes the real tokens only, flattened ([N, d], padding removed), so padding
    never enters the statistics; all ranks of one model-parallel group must pass the same ``h``.
    Parameters: ``hidden`` (Linear d -> H, replicated), ``logits_weight`` [Kl, H] and
    ``logits_bias`` [Kl] (flat: this rank's shard; product: [G*V, H], [G*V]), none of the three
    with ``distance`` logits, and ``codebook`` ([Kl, d] flat shard; [G, V, dg] product).
    :data:`SPLIT_PARAMETERS` lists the split keys.

    Randomness is keyed by ``seed``, the step set by :meth:`set_step` (which also sets the
    temperature, ``max(start * decay**step, end)``), a per-step call counter (so gradient-
    accumulation micro-batches draw different noise) and the dp rank. A caller that runs the
    forward twice for one batch (outer activation checkpointing) must pass the same
    ``noise_key`` both times.

    Frozen use (decoder pre-training): :meth:`freeze` sets ``requires_grad=False`` on every
    parameter; the straight-through gradient still reaches ``h`` (the feature extractor's
    output) while no gradient is computed for the VQ weights. Training mode samples codes by
    Eq. 5; ``forward(h, sample=False)`` picks the noise-free argmax instead and still passes
    the straight-through gradient, through ``softmax(l / tau)``, whenever gradients are enabled.
    """

    def __init__(self, vq: VQConfig, d_model: int, groups: ParallelGroups, seed: int) -> None:
        super().__init__()
        self.config = vq
        self.d_model = d_model
        self.groups = groups
        self.seed = seed
        self.layout = vq.layout
        self._step = 0
        self._calls = 0
        self.distance = vq.logits == "distance"
        if vq.layout == "flat":
            if vq.num_codes % groups.mp_size:
                raise ValueError(
                    f"vq.num_codes {vq.num_codes} is not divisible by the model-parallel size "
                    f"{groups.mp_size}"
                )
            self.num_codes = vq.num_codes
            self.num_local = vq.num_codes // groups.mp_size
            self.code_offset = groups.mp_rank * self.num_local
            rows, width = self.num_local, d_model
        else:
            if d_model % vq.groups:
                raise ValueError(f"d_model {d_model} is not divisible by vq.groups {vq.groups}")
            self.num_codes = vq.entries**vq.groups
            self.num_local = vq.groups * vq.entries
            self.code_offset = 0
            rows, width = self.num_local, d_model // vq.groups
        self.distance_scale = distance_scale(width, vq.distance_width)  # s of -s ||h - z||^2
        self.hidden: nn.Linear | None = None
        self.logits_weight: nn.Parameter | None = None
        self.logits_bias: nn.Parameter | None = None
        if not self.distance:
            self.hidden = nn.Linear(d_model, vq.hidden_dim)
            self.logits_weight = nn.Parameter(torch.empty(rows, vq.hidden_dim))
            self.logits_bias = nn.Parameter(torch.empty(rows))
        if vq.layout == "flat":
            self.codebook = nn.Parameter(torch.empty(rows, width))
            for param in (self.logits_weight, self.logits_bias, self.codebook):
                if param is not None:
                    mark_model_parallel_parameter(param, 0)
        else:
            self.codebook = nn.Parameter(torch.empty(vq.groups, vq.entries, width))
        self.reset_parameters()

    @property
    def split(self) -> bool:
        """Whether the parameters are shards (flat layout over more than one mp rank)."""
        return self.layout == "flat" and self.groups.mp_size > 1

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic, split-independent init from ``seed``.

        Linears: PyTorch's default bound 1/sqrt(fan_in). Codebook: N(0, 1), the per-element
        scale of the LayerNorm'd encoder output that the codes stand in for.
        """
        vq, d = self.config, self.d_model
        seed = self.seed
        start, stop = self.code_offset, self.code_offset + self.num_local
        if self.hidden is not None:
            assert self.logits_weight is not None and self.logits_bias is not None
            bound_h = 1.0 / math.sqrt(d)
            self.hidden.weight.copy_(
                init_rows(seed, TAG_HIDDEN_W, 0, vq.hidden_dim, d, "uniform", bound_h)
            )
            self.hidden.bias.copy_(
                init_rows(seed, TAG_HIDDEN_B, 0, vq.hidden_dim, 1, "uniform", bound_h)[:, 0]
            )
            bound_l = 1.0 / math.sqrt(vq.hidden_dim)
            self.logits_weight.copy_(
                init_rows(seed, TAG_LOGITS_W, start, stop, vq.hidden_dim, "uniform", bound_l)
            )
            self.logits_bias.copy_(
                init_rows(seed, TAG_LOGITS_B, start, stop, 1, "uniform", bound_l)[:, 0]
            )
        table = init_rows(seed, TAG_CODEBOOK, start, stop, self.codebook.shape[-1], "normal", 1)
        self.codebook.copy_(table.view_as(self.codebook))

    # -- schedule ----------------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        """Sets the training step: temperature and noise stream (resets the call counter)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = step
        self._calls = 0

    @property
    def step(self) -> int:
        return self._step

    @property
    def temperature(self) -> float:
        """``max(start * decay**step, end)`` (wav2vec 2.0's schedule)."""
        vq = self.config
        return max(vq.temperature_start * vq.temperature_decay**self._step, vq.temperature_end)

    def _noise_key(self, noise_key: int | None) -> int:
        if noise_key is None:
            noise_key = self._calls
            self._calls += 1
        return mix_key(self.seed, TAG_NOISE, self._step, noise_key, self.groups.dp_rank)

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        h: Tensor,
        *,
        sample: bool | None = None,
        noise_key: int | None = None,
        detach_weights: bool = False,
    ) -> VQOutput:
        """Quantises the real tokens ``h`` [N, d].

        ``sample`` (default: ``self.training``) draws Gumbel noise (Eq. 5); without it the code
        is the argmax of the logits. The straight-through gradient is computed whenever
        gradients are enabled, in either case. ``detach_weights`` uses the weights as
        constants: gradients reach ``h`` only, even when the weights require grad (the
        decoder stage of a joint run reads the codebook the encoder stage trains).
        """
        if h.dim() != 2 or h.shape[1] != self.d_model:
            raise ValueError(f"expected h of shape [N, {self.d_model}], got {tuple(h.shape)}")
        sample = self.training if sample is None else sample
        key = self._noise_key(noise_key) if sample else 0
        codebook = self.codebook.detach() if detach_weights else self.codebook
        if self.layout == "flat":
            out = self._forward_flat(h, sample, key, codebook, detach_weights)
        else:
            act, logits_weight, logits_bias = self._logit_inputs(h, detach_weights)
            weights = (logits_weight, logits_bias, codebook)
            out = self._forward_product(h, act, sample, key, weights)
        gain = self.config.copy_gradient
        if gain and h.requires_grad and torch.is_grad_enabled():
            # VQ-VAE's straight-through beside the Gumbel one: h - h is exactly 0, so the
            # output is still exactly the chosen code, and the gradient of the code reaches
            # h as it is, times the gain (see VQConfig.copy_gradient).
            copy = h - h.detach()
            out = out._replace(quantized=out.quantized + (copy * gain).to(out.quantized.dtype))
        return out

    def _input(self, h: Tensor) -> Tensor:
        """``h`` in the weights' dtype (bf16 features, fp32 layer) unless autocast decides."""
        return h if torch.is_autocast_enabled(h.device.type) else h.to(self.codebook.dtype)

    def _logit_inputs(self, h: Tensor, detach_weights: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``(a, W, b)`` with the code logits ``l = a W^T + b``: [N, H], [rows, H], [rows].

        ``mlp``: a = ReLU(Linear(h)) and the layer's ``logits_weight`` and ``logits_bias``.
        ``distance``: a = h, W = 2 s z, b = -s ||z||^2 for the codes z of width w
        (block-diagonal over the groups of the product layout), i.e. ``-s ||h - z||^2`` up to
        the per-token constant ``s ||h||^2``, which no softmax or argmax sees. The distances
        between a LayerNorm'd output and N(0, 1) codes spread by about sqrt(8 w): with s = 1 /
        sqrt(w) the logits spread by about 3 at any width, as the MLP's do, so the temperature
        schedule and the Gumbel noise act alike. Wider than ``vq.distance_width``, s falls as
        1 / w, so that a partial alignment of h with one code does not saturate the softmax
        (``nn/config.py``). The flat layer's training forward computes the same logits
        from the table itself (``FlatSpec.distance_scale``).
        """
        x = self._input(h)
        if self.distance:
            codebook = self.codebook.detach() if detach_weights else self.codebook
            scaled, bias = distance_logit_weights(codebook, self.distance_scale)
            if self.layout == "flat":
                return x, scaled, bias
            return x, torch.block_diag(*scaled.unbind(0)), bias
        assert self.hidden is not None
        assert self.logits_weight is not None and self.logits_bias is not None
        if detach_weights:
            act = F.relu(F.linear(x, self.hidden.weight.detach(), self.hidden.bias.detach()))
            return act, self.logits_weight.detach(), self.logits_bias.detach()
        # A module call: ZeRO-3 gathers a sub-module's weights again before its backward only
        # for calls of that sub-module.
        return F.relu(self.hidden(x)), self.logits_weight, self.logits_bias

    @torch.no_grad()
    def code_logits(self, h: Tensor) -> Tensor:
        """Noise-free logits [N, rows] fp32 of this rank's codes (flat: its Kl-code shard;
        product: the G*V table entries, group-major), the ``l`` of Eq. 5."""
        act, weight, bias = self._logit_inputs(h, detach_weights=True)
        with torch.autocast(h.device.type, enabled=False):
            return F.linear(act.float(), weight.float(), bias.float())

    def _forward_flat(
        self, h: Tensor, sample: bool, key: int, codebook: Tensor, detach_weights: bool
    ) -> VQOutput:
        weight: Tensor | None = None
        bias: Tensor | None = None
        if self.distance:  # FlatQuantize reads the logit weights from the table itself
            act = self._input(h)
        else:
            act, weight, bias = self._logit_inputs(h, detach_weights)
        act = copy_to_model_parallel(act, self.groups)
        params = (act, weight, bias, codebook)
        needs = [t.requires_grad for t in params if t is not None]
        need_grad = torch.is_grad_enabled() and any(needs)
        spec = FlatSpec(
            groups=self.groups,
            code_offset=self.code_offset,
            num_codes=self.num_codes,
            chunk_tokens=self.config.chunk_tokens,
            keep_bytes=self.config.keep_logits_mib << 20,
            temperature=self.temperature,
            sample=sample,
            noise_key=key,
            from_gumbel=self.config.diversity_from_gumbel,
            need_soft=need_grad or self.config.diversity_from_gumbel,
            out_dtype=h.dtype,
            matmul_dtype=matmul_dtype(codebook if weight is None else weight),
            distance_scale=self.distance_scale if self.distance else 0.0,
            fused=self.config.fused_kernels,
        )
        local_out, psum, codes, greedy, entropy_sum = FlatQuantize.apply(*params, spec)
        quantized = reduce_from_model_parallel(local_out, self.groups)
        owned, local = owned_codes(codes, self.code_offset, self.num_local)
        counts = count_codes(local, self.num_local, owned)
        return self._finish(quantized, codes, greedy, psum, entropy_sum, counts, h.shape[0])

    def _forward_product(
        self, h: Tensor, act: Tensor, sample: bool, key: int, weights: tuple[Tensor, ...]
    ) -> VQOutput:
        logits_weight, logits_bias, codebook = weights
        vq = self.config
        n_tok, groups, entries = h.shape[0], vq.groups, vq.entries
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(act.float(), logits_weight.float(), logits_bias.float())
            scores = logits
            if sample:
                noise = gumbel_noise(key, 0, n_tok, 0, groups * entries, device=h.device)
                scores = logits + noise
            scores = scores.view(n_tok, groups, entries)
            idx = scores.argmax(dim=-1)  # [N, G], first maximum on ties
            weights = F.one_hot(idx, entries).float()
            soft = None
            if torch.is_grad_enabled() or vq.diversity_from_gumbel:
                soft = torch.softmax(scores / self.temperature, dim=-1)
                # Straight-through: forward value exactly the one-hot, gradient of the softmax.
                weights = weights + (soft - soft.detach())
            table = codebook.float()  # [G, V, dg]
            out = torch.einsum("ngv,gvk->ngk", weights, table).reshape(n_tok, self.d_model)
            if vq.diversity_from_gumbel:
                assert soft is not None
                dist_probs = soft
            else:
                dist_probs = torch.softmax(logits.view(n_tok, groups, entries), dim=-1)
            psum = dist_probs.sum(dim=0).reshape(groups * entries)
            # The groups are independent: a code's entropy is the sum of the groups'.
            log_r = torch.log_softmax(logits.view(n_tok, groups, entries), dim=-1)
            entropy_sum = -(log_r.exp() * log_r).sum()
        place = entries ** torch.arange(groups - 1, -1, -1, device=h.device)
        codes = (idx * place).sum(dim=1)
        greedy = codes
        if sample:
            greedy = (logits.view(n_tok, groups, entries).argmax(dim=-1) * place).sum(dim=1)
        flat_idx = (idx + torch.arange(groups, device=h.device) * entries).reshape(-1)
        counts = count_codes(flat_idx, groups * entries)
        return self._finish(out.to(h.dtype), codes, greedy, psum, entropy_sum, counts, n_tok)

    def _finish(
        self,
        quantized: Tensor,
        codes: Tensor,
        greedy: Tensor,
        psum: Tensor,
        entropy_sum: Tensor,
        counts: Tensor,
        n_tok: int,
    ) -> VQOutput:
        """Global-batch statistics: dp sums, entropies, mp sums of the shard entropies."""
        groups = self.groups
        psum = global_batch_sum(psum, groups)
        entropy_sum = global_batch_sum(entropy_sum.reshape(1), groups)[0]
        counts_n = torch.cat([counts, counts.new_full((1,), n_tok)])  # filled, not copied
        all_reduce_data_parallel(counts_n, groups)
        counts, total = counts_n[:-1], counts_n[-1].clamp(min=1).to(torch.float32)
        pbar = psum / total
        hbar = counts.to(torch.float32) / total
        tiny = torch.finfo(torch.float32).tiny
        # x log x with x = 0 -> 0, and a finite gradient there (underflowed probabilities).
        ent_p = -(pbar * pbar.clamp(min=tiny).log())
        ent_h = -(hbar * hbar.clamp(min=tiny).log())
        used = (counts > 0).to(torch.float32)
        if self.layout == "flat":
            pieces = torch.stack([ent_p.sum(), ent_h.sum().detach(), used.sum()])
            # The shards' entropy terms add up to the global entropy; the diversity gradient
            # of each shard flows back through its own terms only (backward identity).
            pieces = reduce_from_model_parallel(pieces, groups)
            diversity = self._diversity(pieces[0], self.num_codes, total)
            stats = pieces.detach()
            prob_ppl, code_ppl = stats[0].exp(), stats[1].exp()
            used_frac = stats[2] / self.num_codes
        else:
            vq = self.config
            ent_p = ent_p.view(vq.groups, vq.entries).sum(dim=1)
            ent_h = ent_h.view(vq.groups, vq.entries).sum(dim=1)
            if vq.diversity_loss == "eq6":
                diversity = -(ent_p / vq.entries).mean()
            elif vq.diversity_loss == "entropy":
                diversity = entropy_shortfall(ent_p, vq.entries, total).mean()
            else:  # wav2vec 2.0: the groups' perplexities add up, at most G * V
                size = vq.groups * vq.entries
                diversity = (size - ent_p.exp().sum()) / size
            prob_ppl, code_ppl = ent_p.detach().exp().sum(), ent_h.detach().exp().sum()
            used_frac = used.mean()
        # No token anywhere (an empty global batch): nothing to spread over the codes.
        diversity = diversity * (counts_n[-1] > 0).to(diversity.dtype)
        return VQOutput(
            quantized=quantized,
            codes=codes,
            diversity_loss=diversity,
            token_entropy=entropy_sum / total,
            code_perplexity=code_ppl,
            prob_perplexity=prob_ppl,
            temperature=self.temperature,
            codes_used=used_frac,
            code_counts=counts,
            greedy_codes=greedy,
        )

    def _diversity(self, entropy: Tensor, size: int, tokens: Tensor) -> Tensor:
        """The flat layout's ``VQConfig.diversity_loss`` of the entropy of pbar over ``size``
        codes and ``tokens`` tokens: ``(size - exp(H)) / size``, Eq. 6's ``-H / size``, or
        :func:`entropy_shortfall`."""
        if self.config.diversity_loss == "eq6":
            return -entropy / size
        if self.config.diversity_loss == "entropy":
            return entropy_shortfall(entropy, size, tokens)
        return (size - entropy.exp()) / size

    # -- codebook access ----------------------------------------------------------------------

    def lookup(self, codes: Tensor) -> Tensor:
        """Code vectors [N, d] for global code ids [N] (flat: the owner's row, summed over mp).

        In the codebook's dtype; differentiable with respect to the codebook unless frozen.
        Every mp rank must call it with the same codes (it is a collective when split).
        """
        codes = codes.reshape(-1)
        if self.layout == "flat":
            owned, local = owned_codes(codes, self.code_offset, self.num_local)
            rows = F.embedding(local, self.codebook).masked_fill(~owned[:, None], 0.0)
            return reduce_from_model_parallel(rows, self.groups)
        vq = self.config
        place = vq.entries ** torch.arange(vq.groups - 1, -1, -1, device=codes.device)
        idx = (codes[:, None] // place) % vq.entries  # [N, G]
        parts = [self.codebook[g, idx[:, g]] for g in range(vq.groups)]
        return torch.cat(parts, dim=1)

    def freeze(self) -> GumbelVectorQuantizer:
        """Stops gradients into every VQ weight (decoder stage); returns ``self``."""
        self.requires_grad_(False)
        return self

    def code_usage(self) -> CodeUsage:
        """An empty :class:`CodeUsage` over all K codes (product: all combinations)."""
        return CodeUsage(self.num_codes, self.groups)

    def extra_repr(self) -> str:
        vq = self.config
        if self.layout == "flat":
            shape = f"codes={self.num_codes}, local=[{self.code_offset}, "
            shape += f"{self.code_offset + self.num_local})"
        else:
            shape = f"groups={vq.groups}, entries={vq.entries}"
        return f"layout={self.layout}, {shape}, d={self.d_model}, hidden={vq.hidden_dim}"
