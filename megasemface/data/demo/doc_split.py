"""Holding out chapters of the Debian Administrator's Handbook for validation and test.

The handbook's ordinary sentence pairs (no code, digit or path) are prose on which copying the
source scores little, unlike the catalogs' software messages. Whole chapters are held out, the
same for every language pair (the English of a chapter is one text), chosen as catalogs are
(demo_corpus.assign_domain_splits); nothing of a held-out chapter, in any language, enters the
monolingual text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megasemface.data.demo.documentation import Documentation

__all__ = ["DEFAULT_DOC_SPLIT", "DocSplit", "DocSplitConfig", "split_documentation"]


@dataclass(frozen=True)
class DocSplitConfig:
    """How many of the handbook's ordinary pairs are held out (assign_domain_splits' terms)."""

    test_pairs: int = 1000
    """At least this many test pairs per language pair, as long as half of its pairs stay
    (the demo translates 1,000 test sentences)."""
    test_fraction: float = 0.35
    valid_fraction: float = 0.1
    """With en-de's 2,664 ordinary pairs, about 270 (the demo validates on 200)."""
    min_pairs: int = 500
    """A language pair whose handbook gives fewer ordinary pairs keeps the catalogs' held-out
    sets."""


DEFAULT_DOC_SPLIT = DocSplitConfig()


@dataclass
class DocSplit:
    """The chapters held out (``chapters[name]``), the held-out pairs of each language pair
    (``pairs[lang]["valid" | "test"]``), every held-out sentence of any language, and the
    monolingual sentences of each language from the chapters kept and the other sources."""

    chapters: dict[str, list[str]] = field(default_factory=dict)
    pairs: dict[str, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    held_out: set[str] = field(default_factory=set)
    mono: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def split_documentation(docs: Documentation, config: DocSplitConfig) -> DocSplit:
    """Chapters to valid and test, by their ordinary pairs; the rest to monolingual text."""
    # demo_corpus imports this module: its splitting function is looked up when called.
    from megasemface.data.demo.demo_corpus import assign_domain_splits

    sizes = {
        lang: {chapter: len(pairs) for chapter, pairs in by_chapter.items()}
        for lang, by_chapter in docs.pairs.items()
        if sum(len(p) for p in by_chapter.values()) >= config.min_pairs
    }
    assignment = (
        assign_domain_splits(
            sizes,
            test_fraction=config.test_fraction,
            valid_fraction=config.valid_fraction,
            min_test_pairs=config.test_pairs,
        )
        if sizes
        else {}
    )
    split = DocSplit(chapters={"valid": [], "test": []})
    for chapter, name in sorted(assignment.items()):
        if name != "train":
            split.chapters[name].append(chapter)
    held = {chapter for names in split.chapters.values() for chapter in names}
    for lang in sizes:
        split.pairs[lang] = {
            name: [p for ch in split.chapters[name] for p in docs.pairs[lang].get(ch, [])]
            for name in ("valid", "test")
        }
    for by_chapter in docs.handbook.values():
        for chapter, sentences in by_chapter.items():
            if chapter in held:
                split.held_out.update(sentences)
    for pairs in split.pairs.values():
        split.held_out.update(text for name in pairs.values() for pair in name for text in pair)
    for lang in sorted({*docs.mono, *docs.handbook}):
        kept = [s for ch, ss in docs.handbook.get(lang, {}).items() if ch not in held for s in ss]
        split.mono[lang] = {"debian_handbook": kept, **docs.mono.get(lang, {})}
    return split
