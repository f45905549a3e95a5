"""Atomic file writes: the umask's mode, and nothing half-written left behind on failure."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megasemface.files import atomic_write_bytes, atomic_write_text, write_atomically


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.usefixtures("umask_022")
def test_files_get_the_umask_mode_even_from_writers_that_use_0600(tmp_path: Path) -> None:
    atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic_write_text(tmp_path / "b.txt", "zwei\r\nÜbersetzung\n")
    # safetensors creates its file with mode 0600 whatever the umask.
    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    write_atomically(tmp_path / "m.safetensors", lambda target: save_file(tensors, str(target)))

    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "zwei\r\nÜbersetzung\n".encode()
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["w"], tensors["w"])
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {
        "a.bin": 0o644,
        "b.txt": 0o644,
        "m.safetensors": 0o644,
    }


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(tmp_path / "new.json", half_then_fail)
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    assert target.read_text() == "old"

    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
