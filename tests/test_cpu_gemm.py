"""nn/cpu_gemm.py: oneDNN's products against torch's, values, gradients and FLOP count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megasemface.flop_count import flop_counter
from megasemface.nn import cpu_gemm
from megasemface.objectives.output_loss import output_cross_entropy

pytestmark = pytest.mark.skipif(not cpu_gemm._have_onednn(), reason="torch built without oneDNN")


@pytest.fixture(params=["onednn", "blas"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with oneDNN's products, once with torch's, whatever this machine's
    default."""
    monkeypatch.setattr(cpu_gemm, "_machine_default", lambda: request.param == "onednn")
    monkeypatch.setattr(cpu_gemm, "_MIN_MULTIPLY_ADDS", 0)  # these tests' products are small
    return request.param


def _linear_call_count(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._overloadpacket is torch.ops.mkldnn._linear_pointwise:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return len(calls)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_f_linear_with_its_gradients(backend: str, bias: bool) -> None:
    torch.manual_seed(0)
    layer = cpu_gemm.Linear(24, 40, bias=bias)
    x = torch.randn(3, 7, 24, requires_grad=True)
    # A non-contiguous incoming gradient, as a transpose downstream gives.
    grad = torch.randn(7, 3, 40).transpose(0, 1)

    def ours() -> None:
        layer(x).backward(grad)

    calls = _linear_call_count(ours)
    assert calls == (3 if backend == "onednn" else 0)  # forward, input and weight gradients
    got = [layer(x).detach(), x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with cpu_gemm.blas_only():
        y = F.linear(x, layer.weight, layer.bias)
        y.backward(grad)
    want = [y.detach(), x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is not None and layer.weight.grad.is_contiguous()


def test_compiled_linear_multiplies_as_eager(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile the layer's three products are still oneDNN's where it is on
    (its own operators, not inductor's BLAS), with F.linear's values and gradients."""
    calls = []
    real = cpu_gemm._onednn_linear
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = cpu_gemm.Linear(24, 40)
    x = torch.randn(3, 7, 24, requires_grad=True)
    grad = torch.randn(3, 7, 40)
    compiled = torch.compile(lambda t: torch.relu(layer(t)) * 2.0, dynamic=True)
    out = compiled(x)
    out.backward(grad)
    torch._dynamo.reset()
    assert len(calls) == (3 if backend == "onednn" else 0)
    got = [out.detach(), x.grad, layer.weight.grad, layer.bias.grad]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with cpu_gemm.blas_only():
        y = torch.relu(F.linear(x, layer.weight, layer.bias)) * 2.0
        y.backward(grad)
    want = [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# A transposed left operand (33 result rows) takes the transposed product where the result's
# columns are fewer than its rows and than the inner rows (many tokens), else the direct one:
# few tokens, or more columns than rows.
@pytest.mark.parametrize(
    ("transposed", "inner", "cols"),
    [(False, 50, 20), (True, 50, 20), (True, 6, 40), (True, 6, 20), (True, 50, 40)],
)
def test_mm_is_the_product(backend: str, transposed: bool, inner: int, cols: int) -> None:
    torch.manual_seed(0)
    a = torch.randn(inner, 33).t() if transposed else torch.randn(33, inner)
    b = torch.randn(inner, cols)
    out = cpu_gemm.mm(a, b)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()
    assert cpu_gemm.mm(torch.empty(0, 5), torch.randn(5, 4)).shape == (0, 4)
    assert cpu_gemm.mm(torch.randn(3, 0), torch.empty(0, 4)).abs().sum() == 0


def test_only_fp32_cpu_tensors_and_never_inside_blas_only(backend: str) -> None:
    on = backend == "onednn"
    assert cpu_gemm.enabled(torch.ones(2)) is on
    assert not cpu_gemm.enabled(torch.ones(2, dtype=torch.float64))
    assert not cpu_gemm.enabled(torch.ones(2, dtype=torch.bfloat16))
    with cpu_gemm.blas_only():
        assert not cpu_gemm.enabled(torch.ones(2))
    assert cpu_gemm.enabled(torch.ones(2)) is on


def test_output_loss_is_the_same_with_either_product(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "_MIN_MULTIPLY_ADDS", 0)
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    results = []
    for on in (True, False):
        monkeypatch.setattr(cpu_gemm, "_machine_default", lambda on=on: on)
        out = output_cross_entropy(h, w, b, t, smoothing=0.1, chunk_logits=50 * 10)
        out.loss.backward()
        results.append([out.loss.detach(), out.nll, out.accuracy, h.grad, w.grad, b.grad])
        h.grad = w.grad = b.grad = None
    for a, c in zip(*results, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_inference_and_small_products(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autograd the product is called directly; below the size where oneDNN pays,
    torch's own runs."""
    torch.manual_seed(0)
    layer = cpu_gemm.Linear(24, 40)
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        want = F.linear(x, layer.weight, layer.bias)
        assert _linear_call_count(lambda: layer(x)) == (1 if backend == "onednn" else 0)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(cpu_gemm, "_MIN_MULTIPLY_ADDS", 21 * 24 * 40 + 1)
        assert _linear_call_count(lambda: layer(x)) == 0
        assert _linear_call_count(lambda: cpu_gemm.mm(x[0], layer.weight.t())) == 0


def test_flop_counter_counts_onednn_products_as_torch_counts_its_own(backend: str) -> None:
    layer = cpu_gemm.Linear(16, 32)
    x = torch.randn(10, 16, requires_grad=True)
    with flop_counter() as counter:
        layer(x).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 10 * 16 * 32


def test_refuses_an_unknown_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV, "mkl")
    cpu_gemm._machine_default.cache_clear()
    try:
        with pytest.raises(ValueError, match="MEGASEMFACE_CPU_GEMM must be auto, blas or onednn"):
            cpu_gemm._machine_default()
        monkeypatch.setenv(cpu_gemm.ENV, "blas")
        cpu_gemm._machine_default.cache_clear()
        assert not cpu_gemm.enabled(torch.ones(2))
        monkeypatch.setenv(cpu_gemm.ENV, "onednn")
        cpu_gemm._machine_default.cache_clear()
        assert cpu_gemm.enabled(torch.ones(2))
    finally:
        monkeypatch.delenv(cpu_gemm.ENV)
        cpu_gemm._machine_default.cache_clear()
