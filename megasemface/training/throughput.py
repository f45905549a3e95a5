"""Training speed as users read it: tokens/s per GPU, model FLOPs utilisation, memory peak.

Model FLOPs utilisation (MFU) is the model's FLOPs per second (its matrix products and
attention at the batch's shape, forward and backward: :mod:`megasemface.training.model_flops`)
over the device's dense peak in the training dtype. The peak is the datasheet's for the GPUs
in :data:`DATASHEET_PEAKS` (found by a part of the name torch reports) and otherwise
measured: the fastest of a quarter second of large matrix products in that dtype when the
loop starts and of one more at every logging step (on a CPU through oneDNN where the models'
products go, :mod:`megasemface.nn.cpu_gemm`), so a CPU run shows its share of what this
machine's products reach.

The memory peak is the device's: ``torch.cuda.max_memory_allocated`` on a GPU (tensors
only, not the caching allocator's reserve), and on a CPU the process's peak resident set
(``ru_maxrss``: tensors, the interpreter and libraries alike), under its own metric name.
"""

from __future__ import annotations

import functools
import resource
import time

import torch

__all__ = [
    "DATASHEET_PEAKS",
    "MatmulProbe",
    "Throughput",
    "datasheet_peak",
    "device_peak",
    "measured_matmul_peak",
    "memory_peak",
]

# Dense tensor-core peaks in FLOP/s (no sparsity) by a part of torch.cuda.get_device_name;
# the first match wins, so the more specific names come first ("H100 PCIe" before "H100",
# "H200" before "H20"). fp32 is the CUDA cores' (torch multiplies fp32 without TF32 unless
# told to).
DATASHEET_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 51.2e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float16": 835e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12, "float32": 66.9e12}),  # SXM (HBM3)
    ("H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 66.9e12}),
    ("H20", {"bfloat16": 148e12, "float16": 148e12, "float32": 44e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12}),
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def datasheet_peak(name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The dense peak FLOP/s of the GPU called ``name`` in ``dtype``, or None when the table
    does not know it."""
    for key, peaks in DATASHEET_PEAKS:
        if key in name:
            return peaks.get(_dtype_name(dtype))
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MatmulProbe:
    """A square product of ``size`` in ``dtype`` on ``device``, timed on request. On a CPU the
    product is the models' own (oneDNN where they use it)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int | None = None) -> None:
        from megasemface.nn.cpu_gemm import mm

        self.device = device
        self.size = size or (8192 if device.type == "cuda" else 1024)
        generator = torch.Generator(device=device).manual_seed(0)
        shape = (self.size, self.size)
        self.a = torch.randn(shape, generator=generator, device=device).to(dtype)
        self.b = torch.randn(shape, generator=generator, device=device).to(dtype)
        self.product = mm if device.type == "cpu" and dtype == torch.float32 else torch.mm
        self.product(self.a, self.b)  # warm up

    def flops_once(self) -> float:
        """FLOP/s of one product."""
        _synchronize(self.device)
        started = time.perf_counter()
        self.product(self.a, self.b)
        _synchronize(self.device)
        return 2.0 * self.size**3 / max(time.perf_counter() - started, 1e-12)

    def fastest(self, seconds: float) -> float:
        """FLOP/s of the fastest of the products timed for ``seconds`` (at least three)."""
        best, timed = 0.0, 0
        deadline = time.perf_counter() + seconds
        while timed < 3 or time.perf_counter() < deadline:
            best = max(best, self.flops_once())
            timed += 1
        return best


@functools.cache
def _probe(device: torch.device, dtype: torch.dtype, size: int | None) -> MatmulProbe:
    return MatmulProbe(device, dtype, size)


@functools.cache
def measured_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float = 0.25
) -> float:
    """FLOP/s of the fastest square product of ``size`` in ``dtype`` on ``device``, timed
    again and again for ``seconds``; once per process and arguments. The fastest of many,
    not of a few: on a shared machine a few products can all meet another process's burst,
    and a peak measured low reads the run's MFU above 100%."""
    return _probe(device, dtype, size).fastest(seconds)


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(dense peak FLOP/s, where it comes from: ``datasheet`` or ``measured``)."""
    if device.type == "cuda":
        peak = datasheet_peak(torch.cuda.get_device_name(device), dtype)
        if peak is not None:
            return peak, "datasheet"
    return measured_matmul_peak(device, dtype), "measured"


def memory_peak(device: torch.device) -> dict[str, float]:
    """The memory high-water mark so far in GiB: ``gpu_memory_peak_gib`` (tensors on the
    GPU) or, on a CPU, ``rss_peak_gib`` (the process's peak resident set)."""
    if device.type == "cuda":
        return {"gpu_memory_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss is in KiB on Linux.
    return {"rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class Throughput:
    """The speed figures of a logging window for ``world`` ranks, one device each.

    A measured peak is measured again, one product, at every :meth:`figures`, and the
    fastest so far is the peak: a machine busy with other work through the first quarter
    second would otherwise leave a peak below what the run's own products reach later, and
    an MFU above 100%."""

    def __init__(self, device: torch.device, world: int, dtype: torch.dtype) -> None:
        self.device = device
        self.world = world
        self.peak, self.peak_source = device_peak(device, dtype)
        self._probe = _probe(device, dtype, None) if self.peak_source == "measured" else None

    def figures(self, tokens: float, flops: float, seconds: float) -> dict[str, float]:
        """``tokens`` and model ``flops`` of every rank over ``seconds``: tokens/s and model
        FLOP/s per device, MFU against :attr:`peak`, and the memory peak."""
        seconds = max(seconds, 1e-9)
        if self._probe is not None:
            self.peak = max(self.peak, self._probe.flops_once())
        per_device = flops / seconds / self.world
        return {
            "tokens_per_s_per_gpu": tokens / seconds / self.world,
            "model_tflops_per_gpu": per_device / 1e12,
            "peak_tflops_per_gpu": self.peak / 1e12,
            "mfu": per_device / self.peak,
            **memory_peak(self.device),
        }
