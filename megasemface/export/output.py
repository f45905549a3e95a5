"""Writing an export directory: built under a temporary name beside it, then renamed.

A directory that exists under the asked name is thus complete; an export that fails leaves
nothing behind, and an existing directory is replaced only when asked to.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from megasemface.export.source import ExportError
from megasemface.files import replace_directory

__all__ = ["write_export"]


def write_export(
    out: str | os.PathLike[str], build: Callable[[Path], None], overwrite: bool
) -> Path:
    """Runs ``build`` on an empty temporary directory beside ``out`` and puts it in place.

    Raises:
        ExportError: ``out`` exists (without ``overwrite``) or cannot be written.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} exists; pass --overwrite to replace it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise ExportError(
            f"cannot write {out}: {exc.strerror or exc}; choose a writable --out"
        ) from None
    try:
        build(tmp)
        replace_directory(tmp, out)
    except OSError as exc:
        raise ExportError(
            f"cannot write {out}: {exc.strerror or exc}; choose a writable --out"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
