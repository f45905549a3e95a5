"""The CPU speed code, applied from outside to the models and processes that run on a CPU.

The model path (:mod:`~megasemface.nn.layers`, the objectives, the VQ layers) is written with
torch's own operators, which every device runs, and on a GPU those are what run. On a CPU,
torch's defaults leave speed behind in four places, each served by a module of its own that
computes what torch's operators do, and this module is the one place that puts them in:

* fp32 products through oneDNN where torch's BLAS runs at half speed (AMD processors with
  AVX-512, :mod:`~megasemface.nn.cpu_gemm`): the Transformer layers' ``nn.Linear`` modules
  become :class:`~megasemface.nn.cpu_gemm.Linear` (same parameters and state-dict names),
  and the output layer's and the VQ codebook's products take :func:`cpu_gemm.mm
  <megasemface.nn.cpu_gemm.mm>` and :func:`~megasemface.nn.cpu_gemm.linear` as the process's
  :mod:`~megasemface.nn.kernels`. Each product still asks :func:`cpu_gemm.enabled
  <megasemface.nn.cpu_gemm.enabled>` when it runs, so on other CPUs (or with
  ``MEGASEMFACE_CPU_GEMM=blas``) they are torch's own.
* dropout masks from a quarter of the random draws (:mod:`~megasemface.nn.dropout`): the
  ``nn.Dropout`` modules and the attention's dropout.
* the VQ layer's passes over large chunks of logits fused by ``torch.compile``
  (:mod:`~megasemface.nn.cpu_passes`).
* freed host memory kept for reuse (:mod:`megasemface.host_memory`), for the process.

When: :func:`apply_cpu_speed` where a model is built for the device it will run on, before
``torch.compile``, the optimizer and DeepSpeed see it (the trainer, the translator, the
diagnostics, the benchmarks); it applies nothing for another device. :func:`prepare_process`
at the start of a process that trains or translates, on any device, since host memory is
what it keeps. A model these calls have not touched computes with torch's own operators:
the same values, up to the products' rounding, and other dropout masks.
"""

from __future__ import annotations

import torch
from torch import nn

from megasemface.host_memory import keep_freed_memory
from megasemface.nn import cpu_gemm, cpu_passes, dropout, kernels
from megasemface.nn.layers import MultiHeadAttention, TransformerLayer

__all__ = ["CPU_KERNELS", "CpuAttention", "apply_cpu_speed", "prepare_process"]

CPU_KERNELS = kernels.Kernels(
    takes=cpu_gemm.enabled,
    mm=cpu_gemm.mm,
    linear=cpu_gemm.linear,
    compiled_passes=cpu_passes.use_compiled,
    run_pass=cpu_passes.run,
)
"""The products and passes a CPU process runs the model path's calls through."""


class CpuAttention(MultiHeadAttention):
    """:class:`~megasemface.nn.layers.MultiHeadAttention` whose attention dropout draws its
    mask as :func:`~megasemface.nn.dropout.dropout` does."""

    attend = staticmethod(dropout.scaled_dot_product_attention)  # type: ignore[assignment]


def apply_cpu_speed(model: nn.Module, device: torch.device | str) -> bool:
    """Puts the CPU speed code into ``model`` when it will run on ``device`` and that is a
    CPU, in place (the modules keep their parameters, buffers, hooks and state-dict names),
    and installs the CPU products and passes for the process. Returns whether it did."""
    if torch.device(device).type != "cpu":
        return False
    kernels.install(CPU_KERNELS)
    for module in model.modules():
        # Exact types: a subclass of these is someone's own choice of computation.
        if type(module) is nn.Dropout:
            module.__class__ = dropout.Dropout
        elif type(module) is MultiHeadAttention:
            module.__class__ = CpuAttention
        elif isinstance(module, TransformerLayer):
            # Only the layers' products: the model's other nn.Linear modules (the VQ
            # layer's, the bridges') stay torch's products, as they were written.
            for inner in module.modules():
                if type(inner) is nn.Linear:
                    inner.__class__ = cpu_gemm.Linear
    return True


def prepare_process() -> bool:
    """Process-wide CPU settings for a process that trains or translates, on any device:
    freed host memory kept for reuse (:func:`~megasemface.host_memory.keep_freed_memory`;
    the logits buffers outgrow glibc's reuse). Returns whether it applied."""
    return keep_freed_memory()
