"""ZeRO-1/2's gradient checks before each step in multi-tensor operations.

Before every step, DeepSpeed's ZeRO-1/2 optimizer checks each gradient of its partition for
inf/NaN (``amax``, ``amin``, ``isfinite`` and their combination: about a dozen operations a
tensor) and takes each one's 2-norm in float64 (a cast and a norm), all launched one by one
from Python: about 16 operations per parameter tensor, some 4,300 small kernels for the paper
preset's 268 tensors, during which a GPU mostly waits for the host. Here both become
``torch._foreach_norm`` calls, a few multi-tensor kernels on a GPU (on a CPU the same
per-tensor norms, looped in C++), with the rest of DeepSpeed's arithmetic kept as it is: the
squares of the per-tensor norms summed, reduced over the data- and model-parallel groups, the
root taken, an inf/NaN norm masked to -1.

On a CPU the norms equal DeepSpeed's bit for bit (``tests/test_zero_grad_checks.py``). On a
GPU the multi-tensor kernel accumulates a bf16 gradient's squares in float32 rather than
float64, as ``torch.nn.utils.clip_grad_norm_`` does: the norm agrees to float32's precision,
which is all that clipping needs.

:func:`install` replaces the two methods on one optimizer instance, and only on the
optimizer class and methods it knows; any other optimizer (ZeRO-3, offload) is left alone.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

__all__ = ["install", "uninstall"]


def has_overflow_partitioned_grads(optimizer: Any) -> torch.Tensor:
    """Whether any gradient of the partition holds an inf or NaN, as a [1] bool tensor.

    A tensor's inf-norm (its largest magnitude) is finite exactly when all its values are:
    the maximum propagates NaN, on CPU and in the multi-tensor GPU kernel."""
    device = optimizer.device
    grads = [  # those DeepSpeed's own check reads, empty ones left out
        grad
        for i in range(len(optimizer.bit16_groups))
        for grad in (optimizer.averaged_gradients[i] or ())
        if grad is not None and grad.numel()
    ]
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=device)
    maxima = torch.stack(torch._foreach_norm(grads, math.inf))
    return torch.isfinite(maxima).logical_not().any().reshape(1).to(device)


def grad_norm_direct(
    optimizer: Any, gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2
) -> torch.Tensor:
    """DeepSpeed's ``get_grad_norm_direct`` for the 2-norm, the per-tensor norms taken in
    one multi-tensor call; any other norm type goes to DeepSpeed's own method."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import (
        is_model_parallel_parameter,
        mask_nan_or_inf_with_val_inplace,
    )
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(optimizer).get_grad_norm_direct(optimizer, gradients, params, norm_type)
    counted = []
    param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
    for grad, param in zip(param_gradients, params, strict=False):
        if hasattr(param, PIPE_REPLICATED) and param.ds_pipe_replicated:
            continue  # pipeline parallelism replicates it: counted by its owner
        if is_model_parallel_parameter(param) or optimizer.model_parallel_rank == 0:
            counted.append(grad.detach())
    if counted:
        norms = torch._foreach_norm(counted, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).to(optimizer.device).pow(2.0).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(optimizer.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
    return total


def install(optimizer: Any) -> bool:
    """Puts the multi-tensor checks on a ZeRO-1/2 optimizer; False (and nothing changed)
    for any other optimizer, or one without the methods and fields they replace."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    needed = (
        "averaged_gradients",
        "bit16_groups",
        "device",
        "dp_process_group",
        "model_parallel_rank",
        "_model_parallel_all_reduce",
        "has_overflow_partitioned_grads_serial",
        "get_grad_norm_direct",
    )
    if type(optimizer) is not DeepSpeedZeroOptimizer or getattr(optimizer, "cpu_offload", True):
        return False
    if not all(hasattr(optimizer, name) for name in needed):
        return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        has_overflow_partitioned_grads, optimizer
    )
    optimizer.get_grad_norm_direct = types.MethodType(grad_norm_direct, optimizer)
    return True


def uninstall(optimizer: Any) -> None:
    """Back to DeepSpeed's own per-tensor checks (benchmarks compare the two)."""
    for name in ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct"):
        vars(optimizer).pop(name, None)
