"""The demo corpus' text from Debian's documentation packages, when they are installed.

Three sources under a documentation root (``/usr/share``): the Debian Administrator's Handbook
(debian_handbook: monolingual text and, aligned, sentence pairs), the Debian Reference
(debian_reference) and manual pages (man_pages), both monolingual. Every sentence is cleaned
(doc_text.clean_sentence) and deduplicated; a target-language sentence that is also an English
sentence of the same source is an untranslated one and is dropped. The English man pages read
are the originals of the translated pages installed for the target languages (the same topics,
and none of the thousands of pages unrelated software installs).

The handbook's ordinary sentence pairs (doc_text.is_ordinary: no code, digit or path in either
language) make the corpus' validation and test sets; its sentences are kept by chapter so that
held-out chapters can be kept out of the monolingual text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasemface.data.demo.debian_handbook import align_pairs, read_handbook
from megasemface.data.demo.debian_reference import read_reference
from megasemface.data.demo.doc_text import (
    clean_sentence,
    is_ordinary,
    split_sentences,
    strip_code_marks,
)
from megasemface.data.demo.man_pages import find_man_pages, read_man_pages
from megasemface.data.demo.message_cleaning import copies_source

__all__ = ["DEFAULT_DOC_ROOT", "PACKAGES", "Documentation", "read_documentation"]

DEFAULT_DOC_ROOT = Path("/usr/share")
PACKAGES = "debian-handbook manpages-de manpages-fr debian-reference-en debian-reference-de " + (
    "debian-reference-fr"
)
"""What ``apt-get install`` installs for en, de and fr (the handbook holds 26 languages)."""
SOURCES = ("debian_handbook", "debian_reference", "man_pages")


@dataclass
class Documentation:
    """Cleaned sentences (code marks removed) per language: ``mono[lang][source]``, the
    handbook's apart, by chapter, in ``handbook[lang][chapter]``; ``pairs[lang][chapter]``
    holds the handbook's ordinary en-``lang`` pairs. ``report`` counts what was read."""

    mono: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    handbook: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    pairs: dict[str, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not any(self.handbook.values()) and not any(
            any(by_source.values()) for by_source in self.mono.values()
        )


def _sentences(paragraphs: list[str], drops: Counter[str]) -> list[str]:
    """The cleaned sentences of paragraphs, code marks removed, in order, each once."""
    kept: dict[str, None] = {}
    for paragraph in paragraphs:
        for sentence in split_sentences(paragraph):
            result = clean_sentence(sentence)
            if result.text is None:
                drops[str(result.reason)] += 1
            else:
                kept[strip_code_marks(result.text)] = None
    return list(kept)


def _ordinary_pairs(pairs: list[tuple[str, str]], drops: Counter[str]) -> list[tuple[str, str]]:
    kept: dict[tuple[str, str], None] = {}
    for en, xx in pairs:
        if not (is_ordinary(en) and is_ordinary(xx)):
            drops["not_ordinary"] += 1
        elif clean_sentence(en).text is None or clean_sentence(xx).text is None:
            drops["not_a_sentence"] += 1
        elif copies_source(en, xx):
            drops["identical"] += 1
        else:
            kept[(en, xx)] = None
    return list(kept)


def _read_handbook(root: Path, langs: list[str], docs: Documentation) -> None:
    book = read_handbook(root, langs)
    if book is None:
        return
    report: dict[str, Any] = {"languages": book.report}
    for lang, pages in book.pages.items():
        drops: Counter[str] = Counter()
        by_chapter: dict[str, list[str]] = {}
        for stem, page in pages.items():
            chapter = book.chapters.get(stem)
            if chapter is not None:
                by_chapter.setdefault(chapter, []).extend(page.paragraphs)
        docs.handbook[lang] = {ch: _sentences(p, drops) for ch, p in sorted(by_chapter.items())}
        report["languages"][lang]["sentence_drops"] = dict(sorted(drops.items()))
        if lang == "en":
            continue
        counts: Counter[str] = Counter()
        aligned = align_pairs(book, lang, counts)
        pair_drops: Counter[str] = Counter()
        docs.pairs[lang] = {ch: _ordinary_pairs(p, pair_drops) for ch, p in aligned.items()}
        report[f"en-{lang}"] = {
            **dict(sorted(counts.items())),
            "sentence_pairs": sum(len(p) for p in aligned.values()),
            "pair_drops": dict(sorted(pair_drops.items())),
            "ordinary_pairs": sum(len(p) for p in docs.pairs[lang].values()),
        }
    docs.report["debian_handbook"] = report


def _read_monolingual(root: Path, langs: list[str], docs: Documentation) -> None:
    translated = {lang: find_man_pages(root, lang) for lang in langs}
    originals = find_man_pages(root, None)
    english_pages = sorted({name for pages in translated.values() for name in pages})
    man_pages = {"en": [originals[n] for n in english_pages if n in originals]}
    man_pages.update({lang: list(pages.values()) for lang, pages in translated.items()})
    for source in ("debian_reference", "man_pages"):
        report: dict[str, Any] = {}
        for lang in ["en", *langs]:
            counts: Counter[str] = Counter()
            if source == "man_pages":
                paragraphs = read_man_pages(man_pages[lang], counts)
            else:
                paragraphs = read_reference(root, lang, counts)
            drops: Counter[str] = Counter()
            docs.mono.setdefault(lang, {})[source] = _sentences(paragraphs, drops)
            report[lang] = {**counts, "sentence_drops": dict(sorted(drops.items()))}
        docs.report[source] = report


def _drop_untranslated(docs: Documentation) -> None:
    """Drops from each target language the sentences its source has in English too."""
    for lang in docs.mono:
        if lang == "en":
            continue
        for source, sentences in docs.mono[lang].items():
            english = set(docs.mono["en"].get(source, ()))
            docs.mono[lang][source] = [s for s in sentences if s not in english]
            docs.report[source][lang]["untranslated"] = len(sentences) - len(
                docs.mono[lang][source]
            )
        english = {s for ss in docs.handbook.get("en", {}).values() for s in ss}
        untranslated = 0
        for chapter, sentences in docs.handbook.get(lang, {}).items():
            docs.handbook[lang][chapter] = [s for s in sentences if s not in english]
            untranslated += len(sentences) - len(docs.handbook[lang][chapter])
        if lang in docs.handbook:
            docs.report["debian_handbook"]["languages"][lang]["untranslated"] = untranslated


def read_documentation(root: Path, langs: list[str]) -> Documentation:
    """What the documentation packages installed under ``root`` give for English and
    ``langs``; empty (``Documentation.empty``) when none is installed."""
    docs = Documentation()
    _read_handbook(root, langs, docs)
    _read_monolingual(root, langs, docs)
    _drop_untranslated(docs)
    return docs
