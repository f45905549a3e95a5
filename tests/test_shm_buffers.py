"""DeepSpeed's shared-memory all-reduce buffers that killed runs left in /dev/shm."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from megasemface.distributed.engine import remove_stale_shm_buffers, warn_stale_extension_lock


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


def test_a_build_lock_left_by_a_killed_build_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The extension's build lock: a fresh one (a build under way) is waited for silently;
    one older than the limit gets a line that names it, and stays (it is not ours)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    warn_stale_extension_lock()
    assert capsys.readouterr().err == ""
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    warn_stale_extension_lock()
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {lock} is 60 min old") and "delete it" in line
    assert lock.exists()
