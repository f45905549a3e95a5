"""The fused output layer and cross-entropy against autograd through the same computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megasemface.objectives.output_loss import output_cross_entropy


def _inputs(tokens: int = 37, dim: int = 16, vocab: int = 50, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    # Some rows predict their target: the accuracy is neither 0 nor 1.
    with torch.no_grad():
        hidden[:9] = weight[targets[:9]] * 4
    return hidden, weight, bias, targets


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_logits", [1 << 24, 50 * 5, 50 * 37 - 1])
@pytest.mark.parametrize("dim", [16, 40])  # smoothing's uniform part after / in the buffers
@pytest.mark.parametrize("weight_of_loss", [3.0, 1.0])  # scales the stored gradients, or not
def test_equals_autograd(
    smoothing: float, chunk_logits: int, dim: int, weight_of_loss: float
) -> None:
    """Loss, NLL, accuracy and the gradients of hidden states, weight and bias, for one chunk,
    chunks of 5 tokens and chunks that leave a short last one; 37 tokens, more and fewer
    than the width."""
    hidden, weight, bias, targets = _inputs(dim=dim)
    out = output_cross_entropy(hidden, weight, bias, targets, smoothing, chunk_logits)
    (weight_of_loss * out.loss).backward()
    fused = _grads(hidden, weight, bias)

    logits = hidden @ weight.t() + bias
    expected = F.cross_entropy(logits, targets, label_smoothing=smoothing)
    # The gradients against float64 autograd: fp32 autograd's own rounding is as large as
    # the differences between two correct fp32 orders of the sums.
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    exact_logits = exact[0] @ exact[1].t() + exact[2]
    exact_loss = F.cross_entropy(exact_logits, targets, label_smoothing=smoothing)
    (weight_of_loss * exact_loss).backward()
    reference = [t.grad for t in exact]

    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    nll = F.cross_entropy(logits.detach(), targets)
    assert out.nll.item() == pytest.approx(nll.item(), rel=1e-6)
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    assert 0 < accuracy < 1
    assert out.accuracy.item() == pytest.approx(accuracy)
    assert not out.nll.requires_grad and not out.accuracy.requires_grad
    for got, want in zip(fused, reference, strict=True):
        assert got.dtype == torch.float32
        # fp32 sums over the width: their rounding grows with it.
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7 * dim / 16)


def test_without_bias_and_frozen_weight() -> None:
    """No bias, and a weight that needs no gradient (a fixed table): only the hidden states
    get one."""
    hidden, weight, _, targets = _inputs()
    weight.requires_grad_(False)
    out = output_cross_entropy(hidden, weight, None, targets, 0.0, chunk_logits=200)
    out.loss.backward()
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    fused = _grads(hidden)[0]
    expected.backward()
    torch.testing.assert_close(fused, hidden.grad, rtol=1e-5, atol=1e-7)
    assert weight.grad is None


def test_no_grad_computes_no_gradients() -> None:
    hidden, weight, bias, targets = _inputs()
    with torch.no_grad():
        out = output_cross_entropy(hidden, weight, bias, targets)
    assert not out.loss.requires_grad
    expected = F.cross_entropy(hidden @ weight.t() + bias, targets)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_bf16_inputs_give_fp32_loss_and_input_dtype_gradients() -> None:
    hidden, weight, bias, targets = _inputs(dtype=torch.bfloat16)
    out = output_cross_entropy(hidden, weight, bias, targets, 0.1, chunk_logits=400)
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    fused = _grads(hidden, weight, bias)
    logits = (hidden @ weight.t() + bias).float()
    F.cross_entropy(logits, targets, label_smoothing=0.1).backward()
    for got, want in zip(fused, _grads(hidden, weight, bias), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


def test_no_tokens_is_nan_like_cross_entropy() -> None:
    hidden, weight, bias, targets = _inputs(tokens=0)
    out = output_cross_entropy(hidden, weight, bias, targets)
    assert math.isnan(out.loss.item()) and math.isnan(out.accuracy.item())
    assert math.isnan(F.cross_entropy(hidden @ weight.t() + bias, targets).item())
