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

Host reads. DeepSpeed's step reads the device three times in bf16 and fp16 (the overflow
flag, whether the gradient norm is finite, and that again before clipping) and twice in fp32;
each makes the host wait for everything queued. One is enough: the norm of gradients holding
an inf or NaN is itself non-finite (masked to -1 above), so the norm's check skips exactly the
steps the flag would, and clipping runs only after it passed. :func:`install` therefore also
answers the separate flag without reading it (when the step computes the norm) and clips
without reading the norm again; the step then reads the device once, in the norm's check.

:func:`install` replaces these methods on one optimizer instance, and only on the optimizer
class and methods it knows; any other optimizer (ZeRO-3, offload) is left alone.
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


def no_separate_overflow_check(optimizer: Any, partition_gradients: bool = True) -> bool:
    """DeepSpeed's ``has_overflow`` for a step that checks its gradient norm: no overflow
    here, without a read of the device; the norm's check that follows skips the step when a
    gradient holds an inf or NaN (module docstring)."""
    return False


def unscale_and_clip_grads(optimizer: Any, grad_groups_flat: list[Any], total_norm: Any) -> None:
    """DeepSpeed's ``unscale_and_clip_grads`` without reading the norm on the host: the step
    calls it only once the norm passed its check, which is the read DeepSpeed's method makes
    again. The same operations, so the same values bit for bit."""
    if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
        return
    combined_scale = optimizer.loss_scale
    if optimizer.clip_grad > 0.0:
        clip = ((total_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
        combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
    for grad in grad_groups_flat:
        for part in grad if isinstance(grad, list) else [grad]:
            part.data.mul_(1.0 / combined_scale)


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
        "has_overflow",
        "unscale_and_clip_grads",
        "clip_grad",
        "loss_scale",
        "compute_grad_norm",
        "check_grad_overflow",
        "dtype",
    )
    if type(optimizer) is not DeepSpeedZeroOptimizer or getattr(optimizer, "cpu_offload", True):
        return False
    if not all(hasattr(optimizer, name) for name in needed):
        return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        has_overflow_partitioned_grads, optimizer
    )
    optimizer.get_grad_norm_direct = types.MethodType(grad_norm_direct, optimizer)
    if norm_checked(optimizer):
        optimizer.unscale_and_clip_grads = types.MethodType(unscale_and_clip_grads, optimizer)
        optimizer.has_overflow = types.MethodType(no_separate_overflow_check, optimizer)
    return True


def norm_checked(optimizer: Any) -> bool:
    """Whether a ZeRO-1/2 step checks its gradient norm and skips itself on an inf or NaN
    (DeepSpeed's ``step``: always but in bf16 with ``check_grad_overflow`` off)."""
    return bool(optimizer.compute_grad_norm) and (
        optimizer.dtype != torch.bfloat16 or bool(optimizer.check_grad_overflow)
    )


REPLACED = (
    "has_overflow_partitioned_grads_serial",
    "get_grad_norm_direct",
    "unscale_and_clip_grads",
    "has_overflow",
)


def uninstall(optimizer: Any) -> None:
    """Back to DeepSpeed's own per-tensor checks (benchmarks compare the two)."""
    for name in REPLACED:
        vars(optimizer).pop(name, None)
