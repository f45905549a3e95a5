"""Paragraphs of manual pages, read from their roff source (``manpages-de``, ``manpages-fr``, and
the English originals of the pages they translate).

Rendering every page through groff or mandoc costs a process per page; the man(7) macros that
carry prose are few, so the source is read directly: text lines in fill mode make paragraphs,
paragraph macros (.PP, .TP, .SH, ...) end them, font macros (.B, .IR, ...) give inline text,
and what is not prose is skipped: the SYNOPSIS, no-fill blocks and examples (.nf, .EX),
tables (.TS), macro definitions, the tag line of .TP and .IP items (an option or a name),
links' addresses. Escapes become their characters; a glyph this reader does not know
becomes U+FFFD, which makes the sentence holding it dropped. Pages in mdoc(7) (BSD) macros
and ``.so`` redirections are skipped and counted.
"""

from __future__ import annotations

import gzip
import re
import unicodedata
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from megasemface.data.demo.doc_text import CODE_END, CODE_START, normalize_space

__all__ = ["MAN_DIR", "find_man_pages", "man_paragraphs", "read_man_pages", "roff_text"]

MAN_DIR = Path("man")

_SKIPPED_SECTIONS = frozenset(("SYNOPSIS", "ÜBERSICHT", "RÉSUMÉ", "SYNTAX"))
_PARAGRAPH_MACROS = frozenset(
    [
        "PP",
        "LP",
        "P",
        "TP",
        "TQ",
        "IP",
        "HP",
        "sp",
        "br",
        "RS",
        "RE",
        "in",
        "ti",
        "SH",
        "SS",
        "bp",
        "ne",
        "PD",
    ]
)
_FONT_MACROS = {"B": "", "I": "", "SM": "", "SB": "", "CW": ""}
_ALTERNATING_MACROS = frozenset(["BR", "RB", "IR", "RI", "BI", "IB"])
_BOLD_MACROS = frozenset(("B", "BR", "BI", "SB"))
_NOFILL = {"nf": "fi", "EX": "EE", "TS": "TE", "EQ": "EN", "SY": "YS", "ig": ".", "de": "."}
_GLYPHS = {
    "em": "—", "en": "–", "hy": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "Bq": "„", "bq": "‚", "Fo": "«", "Fc": "»", "fo": "‹", "fc": "›",
    "bu": "•", "co": "©", "rg": "®", "tm": "™", "mi": "-", "pl": "+", "mu": "×", "di": "÷",
    "de": "°", "ga": "`", "aa": "´", "ha": "^", "ti": "~", "rs": "\\", "sl": "/", "ba": "|",
    "at": "@", "sh": "#", "Do": "$", "ct": "¢", "eu": "€", "Eu": "€", "ps": "£", "Po": "£",
    "sc": "§", "ps2": "¶", "lA": "⇐", "rA": "⇒", "<-": "←", "->": "→", "<=": "≤", ">=": "≥",
    "!=": "≠", "==": "≡", "+-": "±", "ss": "ß", "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ",
    "r!": "¡", "r?": "¿", "Fi": "ffi", "fi": "fi", "fl": "fl", "ff": "ff", "S1": "¹",
    "S2": "²", "S3": "³", "12": "½", "14": "¼", "34": "¾", "dg": "†", "lh": "☜", "rh": "☞",
    "uo": "ü", "R": "®", "Tm": "™", "ua": "↑", "da": "↓",
}  # fmt: skip
_ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303",
            ",": "\u0327", "o": "\u030a", "v": "\u030c"}  # fmt: skip
# One escape: a named glyph or string, a font or size change, a motion or width (dropped
# with its argument), or a one-character escape.
_ESCAPE_RE = re.compile(
    r"""\\(?:
      \((?P<glyph2>..) | \[(?P<glyph>[^\]]*)\]
    | \*(?:\((?P<string2>..)|\[(?P<string>[^\]]*)\]|(?P<string1>.))
    | f(?:\(..|\[[^\]]*\]|.)
    | s[-+]?(?:\d+|\(\d\d|\[[^\]]*\])
    | [hvwoXlLDSbxNZRAB](?P<quote>['"|]).*?(?P=quote)
    | [kmnMgFYV](?:\(..|\[[^\]]*\]|.)
    | (?P<one>.)
    )""",
    re.X,
)
_STRINGS = {"lq": "“", "rq": "”", "R": "®", "Tm": "™", "S": "", "Aq": "'"}
# A .ds request, possibly as the branch of a condition (.ie, .if).
_DEFINE_RE = re.compile(r"^[.'][ \t]*(?:i[ef]\s+\S+\s+)?[.']?ds\s+(\S+)[ \t]+(.*)$", re.M)
_ARGUMENT_RE = re.compile(r'"([^"]*)"?|(\S+)')
_ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", "&": "", "%": "", "|": "", "^": "", "0": " ",
             "~": " ", " ": " ", ":": "", "/": "", ",": "", "c": "", "'": "´", "`": "`",
             ".": ".", "t": " ", "(": "", "d": "", "u": "", "r": "", "p": ""}  # fmt: skip


def _glyph(name: str) -> str:
    if name in _GLYPHS:
        return _GLYPHS[name]
    if re.fullmatch(r"u[0-9A-F]{4,6}", name):
        return chr(int(name[1:], 16))
    if len(name) == 2 and name[0] in _ACCENTS and name[1].isalpha():
        return unicodedata.normalize("NFC", name[1] + _ACCENTS[name[0]])
    return "\ufffd"


def _escape(match: re.Match[str], strings: Mapping[str, str]) -> str:
    if (name := match.group("glyph2") or match.group("glyph")) is not None:
        return _glyph(name)
    string = match.group("string2") or match.group("string") or match.group("string1")
    if string is not None:
        return strings.get(string, "\ufffd")
    one = match.group("one")
    if one is not None:
        return _ONE_CHAR.get(one, "\ufffd")
    return ""  # fonts, sizes, motions, widths, registers


def roff_text(line: str, strings: Mapping[str, str] = _STRINGS) -> str:
    """A roff text line's characters: escapes and ``strings`` resolved, a comment cut off."""
    comment = line.find('\\"')
    if comment >= 0 and not line[:comment].endswith("\\"):
        line = line[:comment]
    line = line.replace(CODE_START, "").replace(CODE_END, "")
    return _ESCAPE_RE.sub(lambda match: _escape(match, strings), line)


def _arguments(text: str) -> list[str]:
    return [
        m.group(1) if m.group(1) is not None else m.group(2) for m in _ARGUMENT_RE.finditer(text)
    ]


def _page_strings(source: str) -> dict[str, str]:
    """The standard strings and those the page defines (``.ds``; the first definition of a
    name wins, which is groff's branch of the usual ``.ie \\n(.g .ds ...`` pair)."""
    defined: dict[str, str] = {}
    for name, value in _DEFINE_RE.findall(source):
        defined.setdefault(name, roff_text(value.removeprefix('"'), _STRINGS))
    return {**_STRINGS, **defined}


def man_paragraphs(source: str) -> list[str] | None:
    """The prose paragraphs of a man(7) page's source; None for mdoc pages and redirections."""
    paragraphs: list[str] = []
    buffer: list[str] = []
    end_of_block: str | None = None
    skip_section = skip_tag = False
    strings = _page_strings(source)

    def flush() -> None:
        text = normalize_space(" ".join(buffer))
        buffer.clear()
        if text:
            paragraphs.append(text)

    for raw in source.splitlines():
        if end_of_block is not None:
            if raw.startswith((f".{end_of_block}", f"'{end_of_block}")):
                end_of_block = None
            continue
        if raw.startswith((".", "'")):
            name, _, rest = raw[1:].lstrip().partition(" ")
            name = name.strip()
            if name in ("Dd", "Sh", "Nm") or name == "so":
                return None
            if name in _NOFILL:
                flush()
                end_of_block = _NOFILL[name]
                continue
            if name in _PARAGRAPH_MACROS:
                flush()
                if name in ("SH", "SS"):
                    title = roff_text(rest, strings).strip().strip('"').upper()
                    skip_section = title in _SKIPPED_SECTIONS
                skip_tag = name in ("TP", "TQ")
                continue
            if skip_section:
                continue
            if name in _FONT_MACROS or name in _ALTERNATING_MACROS:
                if skip_tag:
                    skip_tag = False
                    continue
                joiner = "" if name in _ALTERNATING_MACROS else " "
                text = joiner.join(roff_text(arg, strings) for arg in _arguments(rest))
                # Bold marks commands and options in man pages: code, as far as the
                # corpus is concerned (a line mostly of it is not a sentence).
                buffer.append(f"{CODE_START}{text}{CODE_END}" if name in _BOLD_MACROS else text)
            elif name in ("UE", "ME") and buffer and rest.strip():
                # The link's closing punctuation belongs to the sentence: no space before it.
                buffer[-1] += roff_text(rest.strip(), strings)
            continue  # any other request or macro carries no prose
        if skip_section:
            continue
        if skip_tag:
            skip_tag = False
            continue
        text = roff_text(raw, strings)
        if raw.rstrip().endswith("\\c") and buffer:
            buffer[-1] += text
        else:
            buffer.append(text)
    flush()
    return paragraphs


def find_man_pages(root: Path, lang: str | None) -> dict[str, Path]:
    """The pages of one language (None: the English ones) by ``section/name``; symbolic
    links, aliases of other pages, are left out."""
    base = root / MAN_DIR if lang is None else root / MAN_DIR / lang
    pages: dict[str, Path] = {}
    if not base.is_dir():
        return pages
    for section in sorted(base.glob("man[1-9]*")):
        for path in sorted(section.iterdir()):
            if path.is_file() and not path.is_symlink():
                pages[f"{section.name}/{path.name}"] = path
    return pages


def read_man_pages(paths: list[Path], counts: Counter[str]) -> list[str]:
    """The prose paragraphs of the pages, in order; ``counts`` gets the pages read and those
    skipped (invalid UTF-8, unreadable, mdoc or redirection)."""
    paragraphs: list[str] = []
    for path in paths:
        try:
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            counts["pages_invalid_utf8"] += 1
            continue
        except (OSError, EOFError, gzip.BadGzipFile):
            counts["pages_unreadable"] += 1
            continue
        found = man_paragraphs(text)
        if found is None:
            counts["pages_mdoc_or_redirect"] += 1
            continue
        counts["pages"] += 1
        paragraphs.extend(found)
    counts["paragraphs"] += len(paragraphs)
    return paragraphs
