"""Which catalog messages make corpus sentences, cleaned; and which pairs make dictionary entries.

Messages are UI strings: accelerator markers are removed, spaces collapsed, and strings that are
not sentences (multi-line help texts, placeholders only, control characters, URLs, paths and
addresses, over-long texts) are dropped with a reason, one of the ``DROP_*`` names. Catalogs of
names (is_name_catalog) and translations that copy their source (copies_source) are left out
too: neither teaches translation, and in a test set both reward copying the input.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from fnmatch import fnmatchcase

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DROP_CONTROL_CHARS",
    "DROP_IDENTICAL",
    "DROP_MULTILINE",
    "DROP_NO_LETTERS",
    "DROP_TOO_LONG",
    "DROP_URL_PATH_EMAIL",
    "NAME_CATALOGS",
    "CleanResult",
    "build_dictionary",
    "clean_message",
    "clean_message_with_reason",
    "copies_source",
    "is_dictionary_entry",
    "is_name_catalog",
    "lowercase_words",
    "strip_accelerators",
]

DEFAULT_MAX_CHARS = 200

DROP_MULTILINE = "multiline"
DROP_NO_LETTERS = "no_letters"
DROP_CONTROL_CHARS = "control_chars"
DROP_TOO_LONG = "too_long"
DROP_URL_PATH_EMAIL = "url_path_email"
DROP_IDENTICAL = "identical"  # a translation that copies its source (see copies_source)

NAME_CATALOGS = (
    # iso-codes: languages (639), countries and regions (3166), currencies (4217), scripts (15924)
    "iso_*",
    "tzdata",
    "*timezone*",
    "*locations",  # cities and time zones (libgweather-locations)
    "xkeyboard-config",  # keyboard layouts, named after their languages and countries
)
"""Domains (fnmatch patterns) whose catalogs list names rather than sentences or UI text.

Names make a lexicon, not sentences, and many stay as they are or change by a letter or two
(Luxembourg, Luxemburg): they teach a sentence model little, and a test set full of them is one
that copying the source scores well on.
"""

_LINE_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")
# Non-breaking spaces are typography (French puts one before ':'), not layout: keep them.
_SPACE_RUN_RE = re.compile(r"[^\S\u00a0\u202f]+")
# CJK UIs append the accelerator in brackets: "ファイル(_F)", "打开(&O)...".
_BRACKETED_ACCEL_RE = re.compile(r"\s*\([_&][^\W_]\)")
# An accelerator marker starts a word and precedes a letter: "_File", "Save &As".
_MARKER_RE = re.compile(r"(?<![\w&])[_&](?=[^\W\d_])")
_ENTITY_RE = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);")
_WORD_RE = re.compile(r"\w*")
_URL_PATH_EMAIL_RE = re.compile(
    r"""
      \b[a-z][a-z0-9+.-]*://                  # scheme://host (http, ftp, file, ...)
    | \bwww\.\w                               # bare web address
    | [\w.+-]+@[\w-]+(?:\.[\w-]+)+            # e-mail address
    | (?:^|[\s"'(<\[=`])(?:~|\.{1,2})?/[\w.-]  # absolute, home or relative path
    | \b[a-z]:\\                              # Windows drive path
    """,
    re.I | re.X,
)
_LETTER_RE = re.compile(r"[^\W\d_]")
_LETTERS_RE = re.compile(r"[^\W\d_]+")
_PLACEHOLDER_RE = re.compile(
    r"%(?:\d+\$|\(\w+\))?[-+ #0']*(?:\*|\d+)?(?:\.(?:\*|\d+))?"  # printf and Python %(name)s
    r"(?:hh|h|ll|l|L|j|z|t)?[diouxXeEfFgGaAcspm]"
    r"|\{\w*\}"  # str.format and brace templates
)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc
_WORD_JOINER_RE = re.compile(r"[-'’]")
_JOINERS = frozenset("\u200c\u200d")  # ZWNJ/ZWJ shape Indic and Persian words


@dataclass(frozen=True)
class CleanResult:
    """The cleaned text, or None and the drop reason (one of the ``DROP_*`` names)."""

    text: str | None
    reason: str | None = None


def strip_accelerators(text: str) -> str:
    """Removes keyboard-accelerator markers: ``_File``, ``&File``, ``Datei(_F)``.

    A marker is removed only at a word start before a letter and only when the string has
    exactly one, so identifiers (``file_name``, ``_NET_WM_NAME``), entities (``&amp;``),
    escaped ampersands (``&&``) and strings with several underscores are left alone.
    """
    text = _BRACKETED_ACCEL_RE.sub("", text)
    markers = [m.start() for m in _MARKER_RE.finditer(text) if _is_marker(text, m.start())]
    if len(markers) != 1:
        return text
    return text[: markers[0]] + text[markers[0] + 1 :]


def _is_marker(text: str, pos: int) -> bool:
    """Whether the ``_``/``&`` found by _MARKER_RE at ``pos`` is not an entity or identifier."""
    if text[pos] == "&":
        return _ENTITY_RE.match(text, pos) is None
    word = _WORD_RE.match(text, pos + 1)
    return word is None or "_" not in word.group()  # "_NET_WM_NAME" is an identifier


def clean_message_with_reason(text: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> CleanResult:
    """Cleans one side of a message, or says why it is not corpus material.

    Multi-line strings are dropped before spaces are collapsed: they are help texts and
    tables whose line structure carries meaning that a one-line corpus cannot keep.
    """
    if any(brk in text for brk in _LINE_BREAKS):
        return CleanResult(None, DROP_MULTILINE)
    text = _SPACE_RUN_RE.sub(" ", strip_accelerators(text)).strip()
    # Letters inside placeholders ("%s: %d", "{name}") are not text.
    if not _LETTER_RE.search(_PLACEHOLDER_RE.sub("", text)):
        return CleanResult(None, DROP_NO_LETTERS)
    if _CONTROL_RE.search(text):
        return CleanResult(None, DROP_CONTROL_CHARS)  # terminal escapes, bells
    if len(text) > max_chars:
        return CleanResult(None, DROP_TOO_LONG)
    # The cheap test first: every URL, path and address holds one of these characters.
    if any(ch in text for ch in "/@\\.") and _URL_PATH_EMAIL_RE.search(text):
        return CleanResult(None, DROP_URL_PATH_EMAIL)
    return CleanResult(text)


def clean_message(text: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> str | None:
    """The cleaned text, or None when it is dropped (see clean_message_with_reason)."""
    return clean_message_with_reason(text, max_chars=max_chars).text


def is_name_catalog(domain: str) -> bool:
    """Whether the catalog ``domain`` is one of NAME_CATALOGS."""
    return any(fnmatchcase(domain, pattern) for pattern in NAME_CATALOGS)


def _letters_and_digits(text: str) -> str:
    return "".join(
        ch
        for ch in unicodedata.normalize("NFKC", text).casefold()
        if unicodedata.category(ch)[0] in "LMN"
    )


def copies_source(source: str, target: str) -> bool:
    """Whether ``target`` is ``source`` with at most a change of case, spacing or punctuation.

    Such an entry ("Linux", "socket" -> "Socket", "E-mail" -> "Email") is a string the
    translators left as it is, not a translation: in training it teaches copying, in a test
    set it scores the copy of the source as a perfect translation.
    """
    return _letters_and_digits(source) == _letters_and_digits(target)


def _is_single_word(text: str) -> bool:
    """Letters and combining marks, joined at most by hyphens or apostrophes.

    Marks count because Indic vowel signs are marks, not letters: "ફાઇલ" is one word, and
    so are "E-Mail" and "aujourd'hui".
    """
    parts = _WORD_JOINER_RE.split(text)
    return text[:1].isalpha() and all(
        part and all(ch in _JOINERS or unicodedata.category(ch)[0] in "LM" for ch in part)
        for part in parts
    )


def is_dictionary_entry(source: str, target: str) -> bool:
    """True for a one-word pair: an English word of letters only, a one-word translation."""
    return source.isalpha() and _is_single_word(target) and source.lower() != target.lower()


def lowercase_words(texts: Iterable[str]) -> set[str]:
    """The words written in lower case somewhere in ``texts``."""
    return {word for text in texts for word in _LETTERS_RE.findall(text) if word.islower()}


def build_dictionary(
    pairs: Iterable[tuple[str, str]], common_words: AbstractSet[str]
) -> list[tuple[str, str]]:
    """Lower-cased one-word entries of ``pairs`` whose English is in ``common_words``, sorted.

    Pass lowercase_words() of the English text: a word never written in lower case is taken
    for a name (language, country, program), and names, transliterated rather than
    translated, make poor gold entries for lexicon induction.
    """
    return sorted(
        {
            (source.lower(), target.lower())
            for source, target in pairs
            if is_dictionary_entry(source, target) and source.lower() in common_words
        }
    )
