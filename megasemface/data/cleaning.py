"""Line cleaning and filtering for monolingual corpora.

Every line ends up either kept or dropped for exactly one reason, in this order of checks:
empty, invalid UTF-8, control characters, too many characters, duplicate (optional),
too many tokens. The reasons are counted so that a manifest accounts for every input line.
"""

from __future__ import annotations

import enum
import hashlib
import re

import numpy as np

__all__ = ["DropReason", "clean_line", "line_hash", "status_counts"]


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
_SPACES = re.compile(r"\s+")


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
    text = _SPACES.sub(" ", text).strip()
    if not text:
        return DropReason.EMPTY, ""
    if len(text) > max_chars:
        return DropReason.TOO_LONG_CHARS, ""
    return DropReason.KEPT, text


def line_hash(text: str) -> int:
    """A 64-bit hash of a cleaned line, for exact de-duplication (never 0, the empty slot).

    With 50M distinct sentences the chance of any collision is about n^2 / 2^65 = 7e-5.
    """
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return value or 1


def status_counts(statuses: np.ndarray) -> dict[str, int]:
    """Counts of each DropReason in an array of per-line statuses, by label."""
    counts = np.bincount(statuses, minlength=len(DropReason))
    return {reason.label: int(counts[reason]) for reason in DropReason}
