"""Host memory: keep large freed blocks in the process for the next step to reuse.

glibc's ``malloc`` serves a block above its mmap threshold with a fresh ``mmap`` and unmaps
it when it is freed. The threshold adapts to the blocks a program frees, but never beyond 32
MiB on 64-bit machines, so a step whose largest tensors are bigger than that (the [tokens,
vocab] logits: 1,056 tokens x 8,000 ids is 34 MB, a demo batch's 2,200 tokens 70 MB) maps
them anew on every step and the kernel zero-fills each page on first touch: thousands of
page faults a step even on the tiny joint SemFace step, time spent on memory the previous
step had already filled (``benchmarks/bench_model.py``; figures in docs/results.md). And
glibc returns the top of its heap to the system once more than 128 KiB there is free: at the
paper's shapes, gigabytes of activations freed at the end of every step. PyTorch's CPU
allocator is ``malloc``; on GPUs its caching allocator already keeps device memory this way,
so only host-side work gains.

:func:`keep_freed_memory` raises the mmap threshold to 1 GiB and stops returning the top of
the heap to the system, so freed blocks are reused as they are. Results are bit for bit the
same; the process's resident memory stays at its peak between steps instead of falling back.
Settings the user made through glibc's own environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) are left as they are: setting one of them
(``MALLOC_MMAP_THRESHOLD_=131072`` is glibc's default) turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 1 << 30
"""Blocks up to this size come from the heap and are reused after being freed; larger ones
(a model's weights at the paper's size) are still mapped and unmapped on their own."""

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Tell glibc's ``malloc`` to keep freed blocks of up to :data:`MMAP_THRESHOLD` for reuse
    (call once, early, in a process that trains or translates). Returns whether it did: not
    on another C library, nor where the user configured glibc's allocator."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # The trim threshold first: without it the top of the heap would be released, and
    # faulted in again, whenever a large block at the top is freed. -1 never trims (glibc's
    # mallopt(3)); its largest positive value, 2 GiB, still let the paper preset's joint
    # step release its freed activations at the end of each step and fault them in again,
    # in system time comparable to the step's computing; never trimming, the faults stop
    # after the first steps (docs/results.md).
    return bool(
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(-1))
        and libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD))
    )
