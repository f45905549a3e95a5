"""The output layer and its cross-entropy in one pass over chunks of tokens.

Projecting N hidden states onto a V-word vocabulary and taking the softmax cross-entropy is
the largest part of a small model's training step: on the demo's d 64 model with 8,000 ids,
about half of the SemFace joint step (``benchmarks/bench_model.py``). Through autograd it is
a matmul, a bias add, a log-softmax, an [N, V] zero-filled gradient for the loss, the
log-softmax backward, an argmax over the logits again for the accuracy, and the matmuls of
the backward. Here each chunk of tokens is projected once, and its loss, its accuracy and the
gradient of its logits (softmax minus the smoothed one-hot) come from four passes over that
one buffer (max, subtract, exp, sum); what is linear in the logits (smoothing's mean logit,
the softmax's row scale, its uniform part) is applied on the [C, D] and [V, D] sides
instead. The gradients of the hidden states, weight and bias are formed at once, and
backward only scales them by the incoming gradient. Memory: one chunk of fp32
logits instead of all N (at the paper's 60,000 ids, 280 tokens' worth instead of a batch's).

Shapes: N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megasemface.nn import kernels

__all__ = ["CHUNK_LOGITS", "CHUNK_LOGITS_GPU", "OutputLoss", "output_cross_entropy"]

CHUNK_LOGITS = 1 << 24
"""Logits per chunk on a CPU (64 MiB in fp32): large enough to keep the matmuls efficient."""
CHUNK_LOGITS_GPU = 1 << 28
"""Logits per chunk on a GPU (1 GiB in fp32): a few chunks a batch, so that the per-chunk
kernels (about 20) do not leave the GPU waiting on their launches."""


@dataclasses.dataclass
class OutputLoss:
    loss: torch.Tensor
    """Mean token cross-entropy (label-smoothed if asked), fp32; differentiable."""
    nll: torch.Tensor
    """Mean negative log-likelihood of the targets (the loss without smoothing); detached."""
    accuracy: torch.Tensor
    """Share of tokens whose target has the highest logit (a tie, which fp32 logits do not
    have in practice, counts as correct); detached, on the device."""


def output_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    smoothing: float = 0.0,
    chunk_logits: int | None = None,
) -> OutputLoss:
    """``F.cross_entropy(hidden @ weight.T + bias, targets, label_smoothing=smoothing)`` and
    the argmax accuracy, in fp32 whatever the dtype of the inputs (a large softmax in bf16
    loses the small probabilities); weight and bias are cast to the hidden states' dtype.

    The gradients are computed in the forward when grad mode is on and an input needs one:
    call backward on the loss (or drop it) before the next step, as with any loss. With no
    tokens, the loss and accuracy are NaN, as ``F.cross_entropy``'s mean is.
    """
    if chunk_logits is None:
        chunk_logits = CHUNK_LOGITS if hidden_ND.device.type == "cpu" else CHUNK_LOGITS_GPU
    weight_VD = weight_VD.to(hidden_ND.dtype)
    bias_V = None if bias_V is None else bias_V.to(hidden_ND.dtype)
    inputs = (hidden_ND, weight_VD, bias_V)
    with_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    loss, nll, accuracy = _OutputCrossEntropy.apply(
        hidden_ND, weight_VD, bias_V, targets_N, smoothing, chunk_logits, with_grad
    )
    return OutputLoss(loss, nll, accuracy)


class _OutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        smoothing: float,
        chunk_logits: int,
        with_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, vocab = hidden_ND.shape[0], weight_VD.shape[0]
        rows = max(1, chunk_logits // vocab)
        device = hidden_ND.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        total_nll = torch.zeros_like(total)
        correct = torch.zeros((), dtype=torch.long, device=device)
        # Label smoothing's mean logit of a row and the uniform part of its gradient are
        # linear in the weight's column sums: one read of the weight instead of a pass over
        # every chunk's [C, V] buffer.
        sum_w_D = weight_VD.sum(dim=0, dtype=torch.float32) if smoothing else None
        mean_b = total if bias_V is None else bias_V.float().mean()
        # s / (V N): the uniform part of d loss / d z, the same for every logit.
        uniform = smoothing / (vocab * tokens) if tokens else 0.0
        grad_h = grad_w = grad_b = None
        # Under CUDA autocast the logits' products run in its half dtype; so do the gradient's,
        # accumulating into fp32 results, rather than in the fp32 of the (LayerNorm'd) states.
        autocast = hidden_ND.is_cuda and torch.is_autocast_enabled("cuda")
        grad_dtype = torch.get_autocast_dtype("cuda") if autocast else hidden_ND.dtype
        half_weight_VD = weight_VD
        if with_grad:
            half_weight_VD = weight_VD.to(grad_dtype)  # once a call, not once a chunk
            grad_h = torch.empty_like(hidden_ND)
            # The weight's gradient: the first chunk's product, then accumulated over chunks
            # in fp32 (a bf16 sum of chunks would round at each one), and the uniform part,
            # - s / (V N) times the sum of the states in every row, subtracted after the
            # loop (no [V, D] buffer filled for it). The bias's starts from its uniform
            # part, - s / V in every entry.
            sum_h_D = hidden_ND.sum(dim=0, dtype=torch.float32)
            if bias_V is not None:
                grad_b = torch.full((vocab,), -smoothing / vocab, device=device)
        for start in range(0, tokens, rows):
            h_CD = hidden_ND[start : start + rows]
            t_C = targets_N[start : start + rows]
            if h_CD.is_cuda:
                z_CV = F.linear(h_CD, weight_VD, bias_V).float()
            elif kernels.takes(h_CD):  # the installed product adds the bias in its own pass
                z_CV = kernels.linear(h_CD, weight_VD, bias_V).float()
            else:  # addmm's broadcast copy of the bias into its [C, V] output can take as
                # long as the product itself on a CPU; an add afterwards is one pass.
                z_CV = kernels.mm(h_CD, weight_VD.t()).float()
                if bias_V is not None:
                    z_CV.add_(bias_V)
            target_C = z_CV.gather(1, t_C[:, None]).squeeze(1)
            top_C = z_CV.amax(dim=-1)
            # The target has the highest logit (a tie counts): argmax's answer without its
            # slower pass, as exact in fp32 logits, where ties do not occur.
            correct += (target_C >= top_C).sum()
            e_CV = z_CV.sub_(top_C[:, None]).exp_()  # in place: the one [C, V] buffer
            sum_C = e_CV.sum(dim=-1)
            lse_C = sum_C.log()  # all shifted by the row's max, which cancels
            nll_C = lse_C - (target_C - top_C)
            total_nll += nll_C.sum()
            if sum_w_D is None:
                total += nll_C.sum()
            else:  # (1 - s) nll + s (lse - mean(z)): F.cross_entropy's label smoothing
                # A product and a sum rather than addmv, which CUDA autocast would run in bf16.
                mean_C = (h_CD.float() * sum_w_D).sum(dim=-1) / vocab + mean_b - top_C
                total += ((1.0 - smoothing) * nll_C + smoothing * (lse_C - mean_C)).sum()
            if grad_h is None:
                continue
            # d loss / d z = (softmax - (1 - s) onehot - s / V) / N. The buffer keeps the
            # unnormalised exp(z - max), with the one-hot in its units; the rows' 1 / (sum N)
            # is applied on the [C, D] sides of the products, and the uniform s / (V N) after
            # (hidden states) or before (weight, bias) the loop.
            e_CV.scatter_add_(1, t_C[:, None], (smoothing - 1.0) * sum_C[:, None])
            scale_C = 1.0 / (sum_C * tokens)
            g_CV = e_CV.to(grad_dtype)
            scaled_h_CD = h_CD * scale_C[:, None].to(h_CD.dtype)
            rows_h = grad_h[start : start + rows]
            if g_CV.dtype == hidden_ND.dtype and kernels.takes(g_CV):
                rows_h.copy_(kernels.mm(g_CV, weight_VD))
            elif g_CV.dtype == hidden_ND.dtype:
                torch.mm(g_CV, weight_VD, out=rows_h)
            else:  # half operands into fp32 states (CUDA autocast)
                rows_h.copy_(torch.mm(g_CV, half_weight_VD, out_dtype=torch.float32))
            rows_h.mul_(scale_C[:, None].to(rows_h.dtype))
            product = None
            if grad_w is not None and g_CV.dtype == torch.float32 and not kernels.takes(g_CV):
                grad_w.addmm_(g_CV.t(), scaled_h_CD)  # accumulated in the product's own pass
            elif g_CV.dtype == torch.float32:
                product = kernels.mm(g_CV.t(), scaled_h_CD)
            elif g_CV.is_cuda:  # half operands, fp32 accumulation and result (CUDA only)
                product = torch.mm(g_CV.t(), scaled_h_CD.to(grad_dtype), out_dtype=torch.float32)
            else:
                product = (g_CV.t() @ scaled_h_CD).float()
            if product is not None:
                grad_w = product if grad_w is None else grad_w.add_(product)
            if grad_b is not None:
                grad_b.addmv_(e_CV.t(), scale_C)
        if grad_h is not None and sum_w_D is not None:
            grad_h -= (uniform * sum_w_D).to(grad_h.dtype)
        if grad_h is not None:
            if grad_w is None:  # no tokens
                grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=device)
            if smoothing:
                grad_w.sub_(uniform * sum_h_D)
            ctx.grads = (
                grad_h,
                grad_w.to(weight_VD.dtype),
                None if bias_V is None or grad_b is None else grad_b.to(bias_V.dtype),
            )
        # Means over no tokens are NaN, as F.cross_entropy's.
        # Filled on the device: a tensor made from a host value waits for the copy.
        count = torch.full((), float(tokens) if tokens else float("nan"), device=total.device)
        nll, accuracy = total_nll / count, correct.float() / count
        ctx.mark_non_differentiable(nll, accuracy)
        return total / count, nll, accuracy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,
        _grad_nll: torch.Tensor,
        _grad_accuracy: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.grads  # type: ignore[attr-defined]
        del ctx.grads  # type: ignore[attr-defined]
        scale = grad_loss.float()
        # In place: forward made these tensors for this backward alone, and a new [V, D]
        # gradient would be a fresh allocation (245 MB at the paper's 60,000 x 1,024).
        return (
            grad_h.mul_(scale.to(grad_h.dtype)),
            grad_w.mul_(scale.to(grad_w.dtype)),
            None if grad_b is None else grad_b.mul_(scale.to(grad_b.dtype)),
            None,
            None,
            None,
            None,
        )
