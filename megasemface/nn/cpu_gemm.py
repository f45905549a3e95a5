"""fp32 matrix products on a CPU through oneDNN where torch's BLAS runs at half speed.

torch multiplies fp32 matrices on a CPU with MKL, which on AMD processors runs its AVX2
kernels even where the cores have AVX-512. oneDNN, which torch bundles and which picks its
kernels by instruction set, runs AVX-512 there and multiplies the same matrices about twice
as fast on AMD EPYC cores with AVX-512 (the transformer's and the output layer's products
alike; ``benchmarks/bench_peer.py``, figures in docs/results.md). The
results are fp32 products with fp32 accumulation, equal to MKL's up to rounding (about 1e-6
of their scale).

:func:`enabled` says whether a tensor's products go through oneDNN: fp32 on a CPU whose
vendor is AMD and whose vector unit torch reports as AVX-512 (elsewhere MKL is not known to
leave speed behind), unless ``MEGASEMFACE_CPU_GEMM=blas`` is set (``onednn`` forces it on
wherever torch has oneDNN). :class:`Linear` is ``nn.Linear`` (same parameters and state-dict
names) with its three products through oneDNN; :func:`mm` is ``a @ b``. Under
``torch.compile``, :func:`linear` and its gradients' products are operators of their own
(``megasemface::linear``, ``megasemface::mm``), which make the same choice when they run.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ENV", "Linear", "blas_only", "check_setting", "enabled", "linear", "mm"]

ENV = "MEGASEMFACE_CPU_GEMM"
"""``blas``: torch's own products everywhere; ``onednn``: oneDNN on any CPU that torch built
it for; unset or ``auto``: oneDNN on AMD processors with AVX-512."""

_forced_blas = False


def check_setting() -> str:
    """The setting of :data:`ENV`; ValueError for one it does not know."""
    choice = os.environ.get(ENV, "auto").lower()
    if choice not in ("auto", "blas", "onednn"):
        raise ValueError(f"{ENV} must be auto, blas or onednn, got {choice!r}")
    return choice


@functools.cache
def _machine_default() -> bool:
    choice = check_setting()
    if choice == "blas" or not _have_onednn():
        return False
    if choice == "onednn":
        return True
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and _cpu_vendor() == "AuthenticAMD"


def _have_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def enabled(t: torch.Tensor) -> bool:
    """Whether products of ``t`` (and tensors like it) go through oneDNN (eagerly: under
    ``torch.compile``, :func:`linear` is an operator of its own that asks when it runs)."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and not _forced_blas
        and not torch.compiler.is_compiling()
        and _machine_default()
    )


@contextlib.contextmanager
def blas_only() -> Iterator[None]:
    """torch's own products inside the block (for torch's FLOP counter, which counts only
    its own operators, and for comparisons)."""
    global _forced_blas
    before, _forced_blas = _forced_blas, True
    try:
        yield
    finally:
        _forced_blas = before


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight.T + bias`` for 2-D ``x``; strided operands are taken as they are."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _worth_it(rows: int, inner: int, cols: int) -> bool:
    """oneDNN's call costs a few microseconds more than MKL's: below about 2M multiply-adds
    (64 rows of a d 64 -> 256 map in incremental decoding) MKL is as fast or faster."""
    return rows * inner * cols >= _MIN_MULTIPLY_ADDS


_MIN_MULTIPLY_ADDS = 1 << 21


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D tensors (no autograd); contiguous."""
    if (
        not enabled(a)
        or b.dtype != a.dtype
        or not _worth_it(a.shape[0], a.shape[1], b.shape[1])
        or a.numel() == 0
        or b.numel() == 0
    ):
        return a @ b
    rows, inner, cols = a.shape[0], a.shape[1], b.shape[1]
    if a.stride(-2) == 1 and a.stride(-1) != 1 and cols < min(rows, inner):
        # A transposed left operand (a weight's gradient, grads.T @ states): oneDNN takes it
        # strided as it is, or the transposed product (b.T @ a.T).T is copied back. The
        # latter is faster where the result has more rows than columns and the product
        # runs over more tokens than columns (the tiny output layer's 8,000 x 64 over a
        # batch); the former elsewhere (the paper preset's codebook and FFN weights over
        # a few hundred tokens), by up to 2x either way (docs/results.md).
        return _onednn_linear(b.t(), a).t().contiguous()
    return _onednn_linear(a, b.t())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, its products through oneDNN where :func:`enabled`."""
    if torch.compiler.is_compiling():
        if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
            return torch.ops.megasemface.linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if not _through_onednn(x, weight):
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    ):  # inference: no autograd node to build (decoding calls many small products)
        return _onednn_linear_nd(x, weight, bias)
    return _Linear.apply(x, weight, bias)


def _through_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        enabled(x)
        and weight.dtype == x.dtype
        and x.numel() > 0
        and _worth_it(rows, weight.shape[1], weight.shape[0])
    )


def _onednn_linear_nd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = _onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        x_MK = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_MK, weight)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        ctx.shape = x.shape  # type: ignore[attr-defined]
        return _onednn_linear(x_MK, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return _linear_grads(ctx, grad, mm)


def _linear_grads(
    ctx: Any, grad: torch.Tensor, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``x @ weight.T + bias`` from ``ctx`` (``x`` as [M, K], the weight,
    ``x``'s shape, whether there is a bias), their products through ``product``."""
    x_MK, weight_NK = ctx.saved_tensors
    grad_MN = grad.reshape(-1, weight_NK.shape[0])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = product(grad_MN, weight_NK).view(ctx.shape)
    if ctx.needs_input_grad[1]:
        grad_w = product(grad_MN.t(), x_MK)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad_MN.sum(0)
    return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """``nn.Linear`` whose products go through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# Under torch.compile, a CPU's fp32 product and its gradients are operators of their own,
# which choose between oneDNN and torch's BLAS when they run: inductor would otherwise
# compile F.linear into torch's BLAS products, which are half as fast where oneDNN is used,
# and the compiled step would run slower than the eager one.
@torch.library.custom_op("megasemface::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _through_onednn(x, weight):
        return _onednn_linear_nd(x, weight, bias)
    return F.linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("megasemface::mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return mm(a, b)


@_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def _linear_op_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x.reshape(-1, x.shape[-1]), weight)
    ctx.has_bias = bias is not None
    ctx.shape = x.shape


_linear_op.register_autograd(
    lambda ctx, grad: _linear_grads(ctx, grad, _mm_op), setup_context=_linear_op_setup
)
