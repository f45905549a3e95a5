"""Sentences and sentence pairs from the Debian Administrator's Handbook (``debian-handbook``).

The package installs one HTML book per language, ``<root>/doc/debian-handbook/html/<ll-CC>/``,
every translation made from the same DocBook source: the same files, and in each file the
same paragraphs in the same order. A file's paragraphs therefore align by index when both
languages have as many; a paragraph pair gives sentence pairs when both split into as many
sentences (doc_text.split_sentences). Untranslated paragraphs (the English kept in the
translation) give no pair. Every sentence is filed under its chapter (the number its English
page title starts with), the unit by which the corpus holds text out.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megasemface.data.demo.doc_text import split_sentences
from megasemface.data.demo.html_text import HtmlPage, parse_html_page

__all__ = [
    "HANDBOOK_DIR",
    "Handbook",
    "align_pairs",
    "chapter_of",
    "handbook_language_dir",
    "read_handbook",
]

HANDBOOK_DIR = Path("doc", "debian-handbook", "html")
SOURCE_DIR_PREFIX = "en"

# "Chapter 6. ...", "Kapitel 6. ...", "6.2. ...", "A.1. ...": the chapter is the first number
# (or appendix letter) followed by a period.
_CHAPTER_RE = re.compile(r"(?:^|\s)(\d+|[A-Z])\.(?:\d|\s)")


@dataclass
class Handbook:
    """The pages of each language read, by file stem; ``chapters`` maps every English page to
    its chapter. ``report`` counts what was read and skipped."""

    pages: dict[str, dict[str, HtmlPage]] = field(default_factory=dict)
    chapters: dict[str, str] = field(default_factory=dict)
    report: dict[str, dict[str, int]] = field(default_factory=dict)


def handbook_language_dir(root: Path, lang: str) -> Path | None:
    """The book's directory for a language code (``de`` -> ``de-DE``, ``pt_BR`` -> ``pt-BR``),
    or None; a code that names no region takes the first region in name order."""
    base = root / HANDBOOK_DIR
    if not base.is_dir():
        return None
    wanted = lang.replace("_", "-").split("@", 1)[0].lower()
    dirs = sorted(p for p in base.iterdir() if p.is_dir() and p.name != "Common_Content")
    for path in dirs:
        if path.name.lower() == wanted:
            return path
    for path in dirs:
        if path.name.lower().split("-", 1)[0] == wanted:
            return path
    return None


def chapter_of(title: str, stem: str) -> str:
    """The chapter of a page from its English title; pages without a number are their own."""
    match = _CHAPTER_RE.search(title)
    return match.group(1) if match else stem


def _read_pages(directory: Path, counts: Counter[str]) -> dict[str, HtmlPage]:
    pages: dict[str, HtmlPage] = {}
    for path in sorted(directory.glob("*.html")):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            counts["files_invalid_utf8"] += 1
            continue
        pages[path.stem] = parse_html_page(text)
        counts["files"] += 1
        counts["paragraphs"] += len(pages[path.stem].paragraphs)
    return pages


def read_handbook(root: Path, langs: list[str]) -> Handbook | None:
    """The book in English and in each of ``langs`` that it is translated into; None when
    the English book is not installed under ``root``."""
    source_dir = handbook_language_dir(root, SOURCE_DIR_PREFIX)
    if source_dir is None:
        return None
    book = Handbook()
    for lang in ["en", *langs]:
        directory = source_dir if lang == "en" else handbook_language_dir(root, lang)
        if directory is None:
            continue
        counts: Counter[str] = Counter()
        book.pages[lang] = _read_pages(directory, counts)
        book.report[lang] = {"directory": str(directory), **counts}  # type: ignore[dict-item]
    book.chapters = {stem: chapter_of(page.title, stem) for stem, page in book.pages["en"].items()}
    return book


def align_pairs(
    book: Handbook, lang: str, counts: Counter[str]
) -> dict[str, list[tuple[str, str]]]:
    """Sentence pairs en-``lang`` by chapter, code marks kept, from the files and paragraphs
    whose counts agree; ``counts`` gets what was aligned and skipped, and why."""
    pairs: dict[str, list[tuple[str, str]]] = {}
    for stem, source in book.pages["en"].items():
        target = book.pages[lang].get(stem)
        if target is None:
            counts["files_missing"] += 1
            continue
        if len(source.paragraphs) != len(target.paragraphs):
            counts["files_paragraph_counts_differ"] += 1
            continue
        chapter = pairs.setdefault(book.chapters[stem], [])
        for en_paragraph, xx_paragraph in zip(source.paragraphs, target.paragraphs, strict=True):
            if en_paragraph == xx_paragraph:
                counts["paragraphs_untranslated"] += 1
                continue
            en_sentences = split_sentences(en_paragraph)
            xx_sentences = split_sentences(xx_paragraph)
            if len(en_sentences) != len(xx_sentences):
                counts["paragraphs_sentence_counts_differ"] += 1
                continue
            counts["paragraphs_aligned"] += 1
            chapter.extend(zip(en_sentences, xx_sentences, strict=True))
    return pairs
