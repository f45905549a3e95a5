"""The paragraphs of a DocBook-made HTML page (the Debian Administrator's Handbook, the Debian
Reference), read with the standard library's HTML parser.

A paragraph is the text of a ``<p>`` or ``<div class="para">``; titles, listings (``<pre>``),
tables, navigation and tables of contents are left out, and inline code (``<code>``,
package names, replaceable parts, user input) is wrapped in doc_text.CODE_START/CODE_END.
Paragraphs keep their document order, so two translations of one page made from the same
source align by index.
"""

from __future__ import annotations

from dataclasses import dataclass
from html.parser import HTMLParser

from megasemface.data.demo.doc_text import CODE_END, CODE_START, normalize_space

__all__ = ["HtmlPage", "parse_html_page"]

_VOID = frozenset(
    [
        "area",
        "base",
        "br",
        "col",
        "embed",
        "hr",
        "img",
        "input",
        "link",
        "meta",
        "param",
        "source",
        "track",
        "wbr",
    ]
)
_SKIPPED_TAGS = frozenset(("pre", "table", "script", "style", "head", "nav", "svg"))
# DocBook's generated parts: tables of contents, navigation, title blocks, index terms.
_SKIPPED_CLASSES = frozenset(
    ("toc", "navheader", "navfooter", "docnav", "titlepage", "title", "indexterm", "index")
)
_CODE_TAGS = frozenset(("code", "tt", "kbd", "samp", "var"))
_CODE_CLASSES = frozenset(
    ("pkg", "replaceable", "userinput", "computeroutput", "filename", "command", "option")
)


@dataclass(frozen=True)
class HtmlPage:
    """A page's ``<title>`` and its paragraphs in document order (code marked)."""

    title: str
    paragraphs: tuple[str, ...]


class _ParagraphParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        # Per open element: (tag, opened a paragraph, is skipped, opened code).
        self._stack: list[tuple[str, bool, bool, bool]] = []
        self._skipping = 0
        self._paragraphs = 0
        self._code = 0
        self._buffer: list[str] = []
        self._in_title = False
        self.title: list[str] = []
        self.paragraphs: list[str] = []

    def _flush(self) -> None:
        text = normalize_space("".join(self._buffer))
        self._buffer.clear()
        if text.replace(CODE_START, "").replace(CODE_END, "").strip():
            self.paragraphs.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title" and not self._stack_has("body"):
            self._in_title = True
        if tag in _VOID:
            return
        classes = set((dict(attrs).get("class") or "").split())
        skipped = tag in _SKIPPED_TAGS or bool(classes & _SKIPPED_CLASSES)
        live = not self._skipping and not skipped
        paragraph = live and (tag == "p" or (tag == "div" and "para" in classes))
        if paragraph:
            self._flush()  # a paragraph inside another one ends the outer one's text here
            self._paragraphs += 1
        code = (
            live and bool(self._paragraphs) and (tag in _CODE_TAGS or bool(classes & _CODE_CLASSES))
        )
        if code:
            if not self._code:
                self._buffer.append(CODE_START)
            self._code += 1
        self._skipping += skipped
        self._stack.append((tag, paragraph, skipped, code))

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in _VOID or not self._stack_has(tag):
            return  # a stray end tag: nothing of it is open
        while self._stack:
            open_tag, paragraph, skipped, code = self._stack.pop()
            self._skipping -= skipped
            if code:
                self._code -= 1
                if not self._code:
                    self._buffer.append(CODE_END)
            if paragraph:
                self._flush()
                self._paragraphs -= 1
            if open_tag == tag:
                return

    def handle_data(self, data: str) -> None:
        data = data.replace(CODE_START, "").replace(CODE_END, "")
        if self._in_title:
            self.title.append(data)
        elif self._paragraphs and not self._skipping:
            self._buffer.append(data)

    def _stack_has(self, tag: str) -> bool:
        return any(entry[0] == tag for entry in self._stack)


def parse_html_page(text: str) -> HtmlPage:
    """The title and paragraphs of one page's HTML text."""
    parser = _ParagraphParser()
    parser.feed(text)
    parser.close()
    return HtmlPage(normalize_space("".join(parser.title)), tuple(parser.paragraphs))
