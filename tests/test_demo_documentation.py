"""Sentences from Debian's documentation for the demo corpus: the handbook's HTML aligned by
structure, man pages read from their roff source, on small files written here."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest

from megasemface.data.demo.debian_handbook import HANDBOOK_DIR, align_pairs, read_handbook
from megasemface.data.demo.doc_text import (
    CODE_END,
    CODE_START,
    DROP_CODE_LINE,
    DROP_FEW_WORDS,
    DROP_NOT_TEXT,
    DROP_SYMBOLS,
    clean_sentence,
    is_ordinary,
    split_sentences,
)
from megasemface.data.demo.documentation import read_documentation
from megasemface.data.demo.html_text import parse_html_page
from megasemface.data.demo.man_pages import MAN_DIR, man_paragraphs, read_man_pages

PAGE = """<?xml version="1.0" encoding="UTF-8"?>
<html xmlns="http://www.w3.org/1999/xhtml"><head><title>{title}</title></head><body>
<div class="toc"><dl><dt><a href="x.html">{title}</a></dt></dl></div>
<div class="titlepage"><h2 class="title">{title}</h2></div>
<div class="para">
    {p1}
</div>
<pre class="screen"><code class="command">apt install foo</code></pre>
<div class="sidebar"><p class="title"><strong>TIP</strong></p>
<div class="para">{p2}</div></div>
<ul><li class="listitem"><div class="para">{p3}</div></li></ul>
<table><tr><td>cell text that is not prose</td></tr></table>
</body></html>
"""

EN = {
    "title": "Chapter 3. Existing Setup",
    "p1": 'The <span class="emphasis"><em>first</em></span> step is simple. Edit the file '
    '<code class="filename">/etc/apt/sources.list</code> with care.',
    "p2": "A tip &amp; a trick. It has two sentences.",
    "p3": "Everyone reads the handbook. Nobody forgets it. This one differs.",
}
DE = {
    "title": "Kapitel 3. Analyse des Bestehenden",
    "p1": 'Der <span class="emphasis"><em>erste</em></span> Schritt ist einfach. Bearbeiten Sie '
    'die Datei <code class="filename">/etc/apt/sources.list</code> vorsichtig.',
    "p2": "Ein Tipp &amp; ein Trick. Er hat zwei Sätze.",
    "p3": "Alle lesen das Handbuch, niemand vergisst es. Dieser weicht ab.",
}


def write_handbook(root: Path, stem: str, pages: dict[str, dict[str, str]]) -> None:
    for lang_dir, fields in pages.items():
        path = root / HANDBOOK_DIR / lang_dir / f"{stem}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PAGE.format(**fields), encoding="utf-8")


def test_html_page_gives_its_paragraphs_with_code_marked() -> None:
    page = parse_html_page(PAGE.format(**EN))
    assert page.title == "Chapter 3. Existing Setup"
    assert page.paragraphs == (
        "The first step is simple. Edit the file "
        f"{CODE_START}/etc/apt/sources.list{CODE_END} with care.",
        "A tip & a trick. It has two sentences.",
        "Everyone reads the handbook. Nobody forgets it. This one differs.",
    )


def test_handbook_pairs_align_by_file_paragraph_and_sentence_count(tmp_path: Path) -> None:
    write_handbook(tmp_path, "existing-setup", {"en-US": EN, "de-DE": DE})
    # A file whose translation has another number of paragraphs gives no pair.
    write_handbook(tmp_path, "other", {"en-US": EN, "de-DE": {**DE, "p3": ""}})
    book = read_handbook(tmp_path, ["de", "fr"])
    assert book is not None and set(book.pages) == {"en", "de"}  # no French book installed
    assert book.chapters == {"existing-setup": "3", "other": "3"}
    counts: Counter[str] = Counter()
    pairs = align_pairs(book, "de", counts)
    assert pairs == {
        "3": [
            ("The first step is simple.", "Der erste Schritt ist einfach."),
            (
                f"Edit the file {CODE_START}/etc/apt/sources.list{CODE_END} with care.",
                f"Bearbeiten Sie die Datei {CODE_START}/etc/apt/sources.list{CODE_END} vorsichtig.",
            ),
            ("A tip & a trick.", "Ein Tipp & ein Trick."),
            ("It has two sentences.", "Er hat zwei Sätze."),
        ]
    }
    assert counts == {
        "paragraphs_aligned": 2,
        "paragraphs_sentence_counts_differ": 1,
        "files_paragraph_counts_differ": 1,
    }


def test_documentation_keeps_ordinary_pairs_and_drops_untranslated_text(tmp_path: Path) -> None:
    untranslated = {**DE, "p2": EN["p2"]}  # a paragraph the translation left in English
    write_handbook(tmp_path, "existing-setup", {"en-US": EN, "de-DE": untranslated})
    docs = read_documentation(tmp_path, ["de"])
    # The path's sentence is not ordinary; the untranslated paragraph gives no pair.
    assert docs.pairs == {
        "de": {"3": [("The first step is simple.", "Der erste Schritt ist einfach.")]}
    }
    assert "It has two sentences." in docs.handbook["en"]["3"]
    assert "It has two sentences." not in docs.handbook["de"]["3"]
    assert "Edit the file /etc/apt/sources.list with care." in docs.handbook["en"]["3"]
    assert not docs.empty
    assert read_documentation(tmp_path / "nothing", ["de"]).empty


MAN_PAGE = r""".\" A comment line
.TH DEMO 1 "2024" "demo 1.0" "User Commands"
.ds Aq \(aq
.SH NAME
demo \- show a demonstration
.SH SYNOPSIS
.B demo
[\fB\-v\fR] \fIFILE\fR
.SH DESCRIPTION
The
.B demo
program shows the user\*(Aqs files\(emone at a time.
It reads each file
.I once
and never writes to it.
.PP
A second paragraph with \fBbold\fR text.
.SH OPTIONS
.TP
.BR \-v ", " \-\-verbose
Print what is done, step by step.
.nf
demo \-v /tmp/file
.fi
.SH SEE ALSO
.BR ls (1)
"""


def test_man_page_prose_comes_out_of_its_roff_source() -> None:
    assert man_paragraphs(MAN_PAGE) == [
        "demo - show a demonstration",
        f"The {CODE_START}demo{CODE_END} program shows the user's files—one at a time. "
        "It reads each file once and never writes to it.",
        "A second paragraph with bold text.",
        "Print what is done, step by step.",
        f"{CODE_START}ls(1){CODE_END}",
    ]
    assert man_paragraphs(".so man1/other.1\n") is None
    assert man_paragraphs(".Dd $Mdocdate$\n.Dt DEMO 1\n.Sh NAME\n") is None


def test_man_pages_are_read_compressed_and_invalid_utf8_is_counted(tmp_path: Path) -> None:
    good = tmp_path / MAN_DIR / "de" / "man1" / "demo.1.gz"
    good.parent.mkdir(parents=True)
    good.write_bytes(gzip.compress(MAN_PAGE.encode()))
    bad = good.with_name("bad.1")
    bad.write_bytes(b".TH BAD 1\n.SH NAME\nbad \\- caf\xe9 \xff\n")
    counts: Counter[str] = Counter()
    paragraphs = read_man_pages([bad, good], counts)
    assert paragraphs == man_paragraphs(MAN_PAGE)
    assert counts == {"pages": 1, "pages_invalid_utf8": 1, "paragraphs": 5}


@pytest.mark.parametrize(
    ("paragraph", "sentences"),
    [
        ("One. Two is here! Three?", ["One.", "Two is here!", "Three?"]),
        ("Use e.g. Debian. See Fig. Two.", ["Use e.g. Debian.", "See Fig. Two."]),
        ("Das ist z. B. Debian. Und so weiter.", ["Das ist z. B. Debian.", "Und so weiter."]),
        ("He said “Stop.” Then left.", ["He said “Stop.”", "Then left."]),
        ("Version 1.2 is out. done", ["Version 1.2 is out. done"]),
    ],
)
def test_split_sentences(paragraph: str, sentences: list[str]) -> None:
    assert split_sentences(paragraph) == sentences


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("The system keeps a copy of every file.", None),
        ("$ apt-get install foo bar", DROP_CODE_LINE),
        ("--verbose, --quiet, -q", DROP_CODE_LINE),
        ("-v print the version", DROP_CODE_LINE),
        ("/etc/apt/sources.list /etc/hosts and", DROP_CODE_LINE),
        ("12:30 42 % 7 9 1024 x", DROP_SYMBOLS),
        ("Too short.", DROP_FEW_WORDS),
        ("A \\fBbroken\\fR roff sentence here.", DROP_NOT_TEXT),
    ],
)
def test_clean_sentence_drops_lines_that_are_not_sentences(text: str, reason: str | None) -> None:
    result = clean_sentence(text)
    assert result.reason == reason
    assert (result.text is None) == (reason is not None)


def test_ordinary_sentences_hold_no_code_digit_or_path() -> None:
    assert is_ordinary("Every administrator likes a quiet machine.")
    for text in (
        f"Run {CODE_START}apt{CODE_END} now.",
        "It took 3 days.",
        "Edit sources.list first.",
        "See the /etc directory.",
        "Use the -v option.",
        "Mail root@localhost today.",
    ):
        assert not is_ordinary(text), text
