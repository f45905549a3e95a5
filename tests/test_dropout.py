"""The CPU dropout of nn/dropout.py: its rate, its expectation, its gradient, its seed."""

from __future__ import annotations

import math

import pytest
import torch

from megasemface.nn.dropout import Dropout, dropout

N = 400_000


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_drops_at_the_rate_asked_and_keeps_the_expectation(p: float) -> None:
    torch.manual_seed(0)
    y = dropout(torch.ones(N), p)
    rate = float((y == 0).float().mean())
    # Four standard deviations of a binomial rate: a wrong rate or a biased quarter of the
    # 64-bit draws would be far outside.
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / N)
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, float(kept[0])))
    assert float(kept[0]) == pytest.approx(1 / (1 - p), rel=1e-3)
    # The exact expectation: scaled by the rate actually used (p on a 2**-16 grid).
    assert float(y.double().mean()) == pytest.approx(1.0, abs=4 * math.sqrt(p / (1 - p) / N))


def test_each_quarter_of_a_draw_is_uniform() -> None:
    """Elements 4i..4i+3 share one int64 draw; each position must drop at the same rate."""
    torch.manual_seed(1)
    dropped_Q = (dropout(torch.ones(N), 0.5) == 0).view(-1, 4).float().mean(0)
    assert torch.all((dropped_Q - 0.5).abs() < 4 * math.sqrt(0.25 / (N / 4)))


def test_gradient_is_the_mask_scaled() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.2)
    y.backward(torch.ones_like(y))
    kept = y != 0
    scale = 2**16 / (2**16 - round(0.2 * 2**16))  # the rate used, on its 2**-16 grid
    assert torch.equal(y, x.detach() * kept * scale)
    assert torch.equal(x.grad, kept.float() * scale)


def test_same_seed_same_mask_and_calls_differ() -> None:
    x = torch.ones(10_000)
    torch.manual_seed(7)
    first, second = dropout(x, 0.1), dropout(x, 0.1)
    torch.manual_seed(7)
    assert torch.equal(dropout(x, 0.1), first)
    assert not torch.equal(first, second)


def test_module_is_identity_in_eval_mode_and_at_zero() -> None:
    x = torch.randn(8, 5)
    layer = Dropout(0.5).eval()
    assert layer(x) is x
    assert Dropout(0.0).train()(x) is x
    assert dropout(torch.empty(0, 3), 0.5).shape == (0, 3)


def test_keeps_shape_and_dtype() -> None:
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    y = dropout(x, 0.1)
    assert y.shape == x.shape and y.dtype == torch.bfloat16


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_refuses_a_probability_outside_zero_to_one(p: float) -> None:
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(p)
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(torch.ones(3), p)
