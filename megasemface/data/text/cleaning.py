"""Line cleaning and filtering for monolingual and parallel corpora.

Every line ends up either kept or dropped for exactly one reason, in this order of checks:
invalid UTF-8, control characters, empty, too many characters, duplicate (optional), too
many tokens. The reasons are counted so that a manifest accounts for every input line.

In a parallel corpus the unit is the pair of aligned lines: a pair is kept only when both
of its lines are, and is counted once, for its source line's reason when that line is
dropped, else for its target line's (``clean_aligned``).
"""

from __future__ import annotations

import enum
import hashlib
import re

import numpy as np

from megasemface.data.text.textio import split_lines

__all__ = ["DropReason", "clean_aligned", "clean_block", "clean_line", "clean_lines", "line_hash"]


class DropReason(enum.IntEnum):
    """Why a line was not kept; KEPT (0) for kept lines. Stored as uint8 per line."""

    KEPT = 0
    EMPTY = 1
    INVALID_UTF8 = 2
    CONTROL_CHARS = 3
    TOO_LONG_CHARS = 4
    DUPLICATE = 5
    TOO_LONG_TOKENS = 6

    @property
    def label(self) -> str:
        return self.name.lower()


# C0 controls except tab and newline, DEL, C1 controls, and the Unicode line and paragraph
# separators, which split a "line" for many tools and would silently misalign parallel data.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# The same set less the newline, to check a whole block of lines at once.
_CONTROL_IN_BLOCK = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
# White space other than the plain space that str.split() splits on (controls aside).
_ODD_SPACE = re.compile("[\t\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]")


def _needs_spacing(text: str) -> bool:
    """Whether white-space cleaning would change any line of a control-free block."""
    return (
        "  " in text
        or " \n" in text
        or "\n " in text
        or text.startswith(" ")
        or text.endswith(" ")
        or _ODD_SPACE.search(text) is not None
    )


def clean_line(raw: bytes, max_chars: int) -> tuple[DropReason, str]:
    """Cleans one raw line; returns the reason (KEPT when kept) and the cleaned text.

    Tabs and runs of white space become one space, and the ends are stripped; nothing else
    in the text is changed (SentencePiece normalises the rest).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return DropReason.INVALID_UTF8, ""
    if _CONTROL.search(text):
        return DropReason.CONTROL_CHARS, ""
    text = " ".join(text.split())
    if not text:
        return DropReason.EMPTY, ""
    if len(text) > max_chars:
        return DropReason.TOO_LONG_CHARS, ""
    return DropReason.KEPT, text


def clean_block(block: bytes, max_chars: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Cleans the lines of a raw block cut at line ends, as ``clean_line`` does each line.

    Returns per line its DropReason (uint8), the positions of the kept lines (int64) and
    their texts. Most blocks are valid UTF-8 without control characters or irregular white
    space, which one decode and two searches over the whole block establish; then no line
    needs work of its own. Other blocks are cleaned line by line.
    """
    try:
        text = block.decode("utf-8")
        fast = not _CONTROL_IN_BLOCK.search(text)  # also sends \r\n line ends the slow way
    except UnicodeDecodeError:
        fast = False
    if not fast:
        return clean_lines(split_lines(block), max_chars)
    lines = text.split("\n")
    if lines[-1] == "":  # the block's final line end closes its last line
        lines.pop()
    if _needs_spacing(text):
        lines = [" ".join(line.split()) for line in lines]
    lengths = np.fromiter(map(len, lines), np.int64, len(lines))
    statuses = np.full(len(lines), DropReason.KEPT, dtype=np.uint8)
    statuses[lengths == 0] = DropReason.EMPTY
    statuses[lengths > max_chars] = DropReason.TOO_LONG_CHARS
    kept = np.flatnonzero(statuses == DropReason.KEPT)
    texts = lines if len(kept) == len(lines) else [lines[i] for i in kept]
    return statuses, kept, texts


def clean_lines(lines: list[bytes], max_chars: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``clean_line`` over a list of lines, with the same results as ``clean_block``."""
    statuses = np.empty(len(lines), dtype=np.uint8)
    texts: list[str] = []
    for i, raw in enumerate(lines):
        statuses[i], line = clean_line(raw, max_chars)
        if statuses[i] == DropReason.KEPT:
            texts.append(line)
    return statuses, np.flatnonzero(statuses == DropReason.KEPT), texts


def clean_aligned(
    sides: tuple[bytes | list[bytes], ...], max_chars: int
) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
    """Cleans the same lines of one or more aligned files (a block each, or lists of lines).

    Returns per line its DropReason (uint8: the first dropped side's reason), the positions
    of the lines kept on every side (int64), and per side the texts of those lines. With
    one side this is ``clean_block`` (or ``clean_lines``).
    """
    cleaned = [
        clean_block(side, max_chars) if isinstance(side, bytes) else clean_lines(side, max_chars)
        for side in sides
    ]
    statuses = cleaned[0][0]
    for side_statuses, _, _ in cleaned[1:]:
        statuses = np.where(statuses == DropReason.KEPT, side_statuses, statuses)
    kept = np.flatnonzero(statuses == DropReason.KEPT)
    texts = [
        side_texts
        if len(side_kept) == len(kept)  # kept on this side = kept on every side
        else [side_texts[i] for i in np.searchsorted(side_kept, kept)]
        for _, side_kept, side_texts in cleaned
    ]
    return statuses, kept, texts


def line_hash(text: str) -> int:
    """A 64-bit hash of a cleaned line, for exact de-duplication (never 0, the empty slot).

    With 50M distinct sentences the chance of any collision is about n^2 / 2^65 = 7e-5.
    """
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return value or 1
