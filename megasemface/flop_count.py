"""Model FLOPs of a step: torch's FlopCounterMode, with the products it does not count.

FlopCounterMode counts ``mm``, ``addmm``, ``bmm`` and the CUDA attention kernels. It does not
count the in-place ``addmm_`` with which the fused output loss
(:mod:`megasemface.objectives.output_loss`) and the flat VQ layer
(:mod:`megasemface.interfaces.vq.flat`) accumulate their weights' gradients over chunks, nor
the CPU attention kernel and its backward, nor oneDNN's products
(:mod:`megasemface.nn.cpu_gemm`): work that autograd's form of the same step runs as
counted ``mm`` and attention calls. Left out, a fused step's FLOPs, and so its FLOP/s and
share of a peak, read low: of the paper preset's joint SemFace step
(``benchmarks/bench_model.py``), the stock count left out 41 of 437 GFLOP.
:func:`flop_counter` counts them as their out-of-place forms are counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_counter"]

aten = torch.ops.aten


def _addmm_inplace(
    self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * n * k


def _onednn_linear(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    m = 1
    for size in x_shape[:-1]:
        m *= size
    return 2 * m * w_shape[0] * w_shape[1]


def _cpu_attention(
    q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_attention_backward(
    grad_shape: Any,
    q_shape: Any,
    k_shape: Any,
    v_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kw: Any,
) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (no display) that also counts ``addmm_``, CPU attention and oneDNN's
    products."""
    mapping: dict[Any, Any] = {
        aten.addmm_: _addmm_inplace,
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    }
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        mapping[torch.ops.mkldnn._linear_pointwise] = _onednn_linear
    return FlopCounterMode(display=False, custom_mapping=mapping)
