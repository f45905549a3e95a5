"""Line-aligned text files (sources, translations, references) read and written strictly.

Unlike corpus reading (``textio.py``), which drops and counts bad lines,
these files are line-aligned with each other, so a bad line is an error naming the file and
line: dropping it would shift every later line against its reference.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["TextFileError", "check_writable", "one_line", "read_lines", "write_lines"]


class TextFileError(ValueError):
    """A line-aligned file cannot be read as UTF-8 text."""


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 file (``-``: standard input), without their line ends.

    Only ``\\n`` (and a ``\\r`` before it) ends a line, as in sacreBLEU and SentencePiece, so
    other Unicode line separators stay inside their line.

    Raises:
        FileNotFoundError: no such file.
        TextFileError: a line is not valid UTF-8 (the message gives its number).
    """
    name = "<stdin>" if str(path) == "-" else str(path)
    if str(path) == "-":
        data = sys.stdin.buffer.read()
    else:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such file: {path}")
        data = Path(path).read_bytes()
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()  # the final line end ends the last line, it does not start a new one
    lines = []
    for number, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TextFileError(
                f"{name}:{number}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the "
                "line); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8"
            ) from None
        lines.append(text[:-1] if text.endswith("\r") else text)
    return lines


def one_line(text: str) -> str:
    """``text`` with its line ends as spaces (a byte-level model can generate them)."""
    return text.replace("\r", " ").replace("\n", " ")


def write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Writes one line per item (``-``: standard output); line ends inside an item become
    spaces (:func:`one_line`), so that the output stays line-aligned with the input."""
    text = "".join(one_line(line) + "\n" for line in lines)
    if str(path) == "-":
        # Bytes, so that the output is UTF-8 whatever the terminal's locale says.
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        Path(path).write_text(text, encoding="utf-8")


def check_writable(path: str | Path, option: str = "--output") -> None:
    """Refuses an output file (``-``: standard output) that cannot be written, before the
    work that fills it: a directory, or a file in a directory that does not exist."""
    if str(path) == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a directory; name a file")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"{option} {path}: the directory {target.parent} does not exist")
