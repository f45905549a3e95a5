"""DeepSpeed's shared-memory all-reduce buffers that killed runs left in /dev/shm."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from megasemface.distributed.engine import remove_stale_shm_buffers


def test_stale_buffers_go_while_mapped_and_young_ones_stay(tmp_path: Path) -> None:
    name = "deepspeed_allreduce_buffer_{}_127.0.0.1_29500_0"
    stale, live, young = (tmp_path / name.format(tag) for tag in ("stale", "live", "young"))
    other = tmp_path / "not_a_buffer"
    for path in (stale, live, young, other):
        path.write_bytes(bytes(4096))
    hour_ago = time.time() - 3600
    for path in (stale, live, other):
        os.utime(path, (hour_ago, hour_ago))
    # A running rank keeps its buffer mapped: this process maps `live`.
    with open(live, "r+b") as file, mmap.mmap(file.fileno(), 0):
        assert remove_stale_shm_buffers(tmp_path) == [stale]
    assert [p.exists() for p in (stale, live, young, other)] == [False, True, True, True]
    assert remove_stale_shm_buffers(tmp_path, min_age_s=0) == sorted([live, young])
