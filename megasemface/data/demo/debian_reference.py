"""Paragraphs of the Debian Reference (``debian-reference-en``, ``-de``, ``-fr``, ...).

Each language's package installs the book as HTML pages ``<root>/debian-reference/<page>.<lang>
.html`` (``ch02.de.html``). Translations are partial: untranslated paragraphs stay in English,
which the corpus builder removes from the other languages' text (it drops any target-language
sentence that is also an English sentence of the same source).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from megasemface.data.demo.html_text import parse_html_page

__all__ = ["REFERENCE_DIR", "read_reference"]

REFERENCE_DIR = Path("debian-reference")


def read_reference(root: Path, lang: str, counts: Counter[str]) -> list[str]:
    """The paragraphs (code marked) of every page in ``lang``, in page order; ``counts`` gets
    the files read and those skipped for invalid UTF-8. Empty when the book is not installed."""
    directory = root / REFERENCE_DIR
    paragraphs: list[str] = []
    if not directory.is_dir():
        return paragraphs
    for path in sorted(directory.glob(f"*.{lang}.html")):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            counts["files_invalid_utf8"] += 1
            continue
        counts["files"] += 1
        paragraphs.extend(parse_html_page(text).paragraphs)
    counts["paragraphs"] += len(paragraphs)
    return paragraphs
