"""Sentences from documentation prose: splitting paragraphs, and which sentences to keep.

The documentation readers (debian_handbook, debian_reference, man_pages) turn their markup into
paragraphs of plain text in which inline code (commands, file names, options, package names)
is wrapped in CODE_START ... CODE_END. Sentences keep that code as text for monolingual
pre-training, but a sentence that holds code, a digit, a path or an option is not an
ordinary sentence (is_ordinary): the ordinary ones make a test set on which copying the
source scores little. Whole lines that are commands, paths, option lists or mostly symbols
are not sentences at all (clean_sentence drops them with a reason).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "CODE_END",
    "CODE_START",
    "DROP_CODE_LINE",
    "DROP_FEW_WORDS",
    "DROP_NOT_TEXT",
    "DROP_SYMBOLS",
    "DROP_TOO_LONG",
    "MAX_SENTENCE_CHARS",
    "SentenceResult",
    "clean_sentence",
    "is_ordinary",
    "normalize_space",
    "split_sentences",
    "strip_code_marks",
]

# Private-use characters: no documentation text holds them (readers remove any they meet).
CODE_START = "\ue000"
CODE_END = "\ue001"
MAX_SENTENCE_CHARS = 400
_MIN_WORDS = 3

DROP_TOO_LONG = "too_long"
DROP_FEW_WORDS = "few_words"
DROP_SYMBOLS = "mostly_symbols"
DROP_CODE_LINE = "command_path_or_options"
DROP_NOT_TEXT = "unrendered_markup"

_SPACE_RE = re.compile(r"\s+")
# A sentence ends at . ! ? or … (with any closing quotes or brackets) before a space and a
# capital, an opening quote or bracket, or inline code.
_BOUNDARY_RE = re.compile(
    rf"""(?<=[.!?…])(?P<close>["'”’»)\]]*)\s+(?=[\"“„«'(\[¿¡{CODE_START}]*[^\W\d_])""", re.X
)
# Words after which a period does not end the sentence (lower-cased, without the period).
_ABBREVIATIONS = frozenset((
    "e.g", "i.e", "etc", "cf", "vs", "approx", "dr", "mr", "mrs", "ms", "no", "fig", "sect",
    "ch", "vol", "resp", "incl", "esp", "ca", "z.b", "d.h", "u.a", "bzw", "usw", "ggf", "evtl",
    "inkl", "vgl", "bspw", "sog", "abs", "nr", "kap", "s.o", "s.u", "z.t", "u.u", "o.ä", "p.ex",
    "c.-à-d", "c.à.d", "env", "ex", "mme", "mlle", "éd",
))  # fmt: skip
_WORD_RE = re.compile(r"[^\W\d_]{2,}")
_LETTER_RE = re.compile(r"[^\W\d_]")
_NOT_LETTER_RE = re.compile(r"[\W\d_]+")
_CODE_RE = re.compile(f"{CODE_START}[^{CODE_END}]*{CODE_END}")
# Tokens that are code however they are marked up: an option, a path, an assignment, a
# variable, a pipe, a prompt.
_CODE_TOKEN_RE = re.compile(
    r"""^(?:--?[\w-]+[=\w,-]*|[~.]{0,2}/\S*|\S*/\S*/\S*|\w+=\S*|\$\S+|[|<>&;{}]+|\S*\(\)\S*)$"""
)
_PROMPT_RE = re.compile(r"^(?:[$#%]|\S+[$#]) ")
# What an ordinary sentence never holds: digits, path and code characters, and dotted names
# (file names, host names, URLs).
_NOT_ORDINARY_RE = re.compile(r"[\d/\\_=<>@$~|{}\[\]#*^`+]|\w\.\w")
# Markup the readers could not render ("\fB", "&amp;", "\(em") means a broken sentence.
_MARKUP_RE = re.compile(r"\\[(\[*fsef&-]|&(?:[a-z]+|#\d+);|\ufffd")


@dataclass(frozen=True)
class SentenceResult:
    """A cleaned sentence (code marks kept) or None, and why it was dropped."""

    text: str | None
    reason: str | None = None


def normalize_space(text: str) -> str:
    return _SPACE_RE.sub(" ", text).strip()


def strip_code_marks(text: str) -> str:
    return text.replace(CODE_START, "").replace(CODE_END, "")


def _ends_abbreviation(text: str) -> bool:
    """Whether the period ending ``text`` belongs to an abbreviation or an initial."""
    word = text.rsplit(None, 1)[-1].rstrip(".").lower().lstrip("(\"'“„«")
    return len(word) <= 1 or word in _ABBREVIATIONS or ("." in word and len(word) <= 6)


def split_sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences, spaces normalized; code marks are kept.

    Deterministic and language-light (Latin-script punctuation; abbreviations of English,
    German and French): a pair of paragraphs whose splits disagree is dropped by the caller,
    so a wrong split costs a pair rather than misaligning one.
    """
    paragraph = normalize_space(paragraph)
    if not paragraph:
        return []
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY_RE.finditer(paragraph):
        piece = paragraph[start : match.end("close")]
        following = paragraph[match.end() :].lstrip("\"“„«'([¿¡")[:1]
        if following != CODE_START and not following.isupper():
            continue  # "1.2 is out. done": a sentence starts with a capital
        if piece.endswith(".") and _ends_abbreviation(piece):
            continue
        sentences.append(piece.strip())
        start = match.end()
    sentences.append(paragraph[start:].strip())
    return [s for s in sentences if s]


def _is_code_line(text: str) -> bool:
    """A command, path, option list or listing rather than a sentence."""
    plain = strip_code_marks(text)
    if _PROMPT_RE.match(plain) or plain.startswith("-"):
        return True
    tokens = plain.split()
    code = sum(1 for token in tokens if _CODE_TOKEN_RE.match(token.strip(",.;:()\"'")))
    marked = sum(len(m.group()) for m in _CODE_RE.finditer(text))
    return code * 2 >= len(tokens) or marked * 2 >= len(text)


def clean_sentence(text: str) -> SentenceResult:
    """The sentence, or None with the reason it is not one (code marks are kept)."""
    text = normalize_space(text)
    plain = strip_code_marks(text)
    if len(plain) > MAX_SENTENCE_CHARS:
        return SentenceResult(None, DROP_TOO_LONG)
    if _MARKUP_RE.search(plain):
        return SentenceResult(None, DROP_NOT_TEXT)
    if _is_code_line(text):
        return SentenceResult(None, DROP_CODE_LINE)
    visible = len(plain) - plain.count(" ")
    letters = len(_NOT_LETTER_RE.sub("", plain))
    if letters * 2 < visible or not _LETTER_RE.match(plain.lstrip("\"'“„«¿¡(")[:1] or "0"):
        return SentenceResult(None, DROP_SYMBOLS)
    if len(_WORD_RE.findall(_CODE_RE.sub(" ", text))) < _MIN_WORDS:
        return SentenceResult(None, DROP_FEW_WORDS)
    return SentenceResult(text)


def is_ordinary(text: str) -> bool:
    """A sentence of words only: no inline code, digit, path, option, address or symbol of
    code, so that copying it into another language gains next to nothing."""
    if CODE_START in text:
        return False
    return not _NOT_ORDINARY_RE.search(text) and not any(
        token.startswith("-") for token in text.split()
    )
