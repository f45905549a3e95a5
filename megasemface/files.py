"""Atomic file writes, and file digests read in blocks.

Atomic writes: a reader (or a restarted job) sees the old file or the new one, never half.

A file is written to a temporary file next to it, flushed to disk, then renamed into place; on
any failure the temporary file is removed and the target is left as it was. The new file gets
the mode the umask gives (0644 under the usual 022), also when the writer would create it with
another: ``tempfile.mkstemp`` and safetensors' ``save_file`` create files with mode 0600, which
hides a model or a corpus from the other users of a shared machine.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "file_sha256",
    "fsync_directory",
    "replace_directory",
    "write_atomically",
]


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Have ``write`` create the file at a temporary path next to ``path``, then rename it there.

    For writers that only take a file name (``safetensors.torch.save_file``). ``write`` may
    replace the temporary file it is given; the result gets the umask's mode all the same.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # "x": never clobbers anything. Created here so that its mode is the umask's; reading
        # the mode back is thread-safe, unlike os.umask().
        with open(tmp, "xb"):
            pass
        mode = tmp.stat().st_mode & 0o7777
        write(tmp)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    write_atomically(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically, as it is (no newline translation)."""
    atomic_write_bytes(path, text.encode(encoding))


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries to disk, so that a rename into it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(built: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Put the directory ``built`` (complete, under a temporary name beside ``path``) in
    place of ``path``, removing what was there: a reader finds the old directory, no
    directory, or the new one, never a half-written one."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    os.replace(built, path)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The file's sha256 hex digest, read in 1 MiB blocks (memory stays flat for any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
