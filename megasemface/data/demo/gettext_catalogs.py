"""Reading compiled gettext catalogs (``.mo`` files), as installed under ``/usr/share/locale``."""

from __future__ import annotations

import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Catalog", "Message", "MoFormatError", "find_catalogs", "parse_mo", "read_mo"]

_MO_MAGIC = 0x950412DE
_MO_HEADER_SIZE = 28  # magic, revision, count, two table offsets, hash size and offset
_MO_MAJOR_REVISIONS = (0, 1)

_CHARSET_RE = re.compile(rb"^content-type:[^\n]*?charset\s*=\s*([^\s;]+)", re.I | re.M)


class MoFormatError(ValueError):
    """A file is not a well-formed gettext ``.mo`` catalog."""


@dataclass(frozen=True)
class Message:
    """One catalog entry: context stripped, plural forms reduced to the singular.

    ``msgstr`` is empty when the entry is untranslated.
    """

    msgid: str
    msgstr: str
    context: str | None = None
    plural: bool = False


@dataclass(frozen=True)
class Catalog:
    """A parsed ``.mo`` file. The counts are independent: a plural entry may be untranslated.

    ``entries`` counts every entry but the header; entries that do not decode in the
    catalog's charset are counted in ``undecodable`` and left out of ``messages``.
    """

    path: Path
    domain: str
    charset: str
    charset_known: bool
    messages: tuple[Message, ...]
    entries: int
    contexts: int
    plurals: int
    untranslated: int
    undecodable: int


def read_mo(path: str | os.PathLike[str]) -> Catalog:
    """Reads a gettext ``.mo`` catalog; raises MoFormatError when it is malformed."""
    path = Path(path)
    return parse_mo(path.read_bytes(), path=path)


def parse_mo(data: bytes, *, path: str | os.PathLike[str] = "<memory>.mo") -> Catalog:
    """Parses the bytes of a ``.mo`` catalog in either byte order; the domain is the file stem.

    Every offset and length is checked against the file size before it is used, so a
    truncated or corrupt file raises MoFormatError instead of yielding garbage.
    """
    path = Path(path)
    size = len(data)
    if size < _MO_HEADER_SIZE:
        raise MoFormatError(f"{path}: {size} bytes, shorter than the {_MO_HEADER_SIZE}-byte header")
    for order in ("<", ">"):
        if struct.unpack_from(order + "I", data)[0] == _MO_MAGIC:
            break
    else:
        raise MoFormatError(f"{path}: bad magic number 0x{data[:4].hex()}, not a gettext catalog")
    revision, count, orig_offset, trans_offset, hash_size, hash_offset = struct.unpack_from(
        order + "6I", data, 4
    )
    if revision >> 16 not in _MO_MAJOR_REVISIONS:
        raise MoFormatError(
            f"{path}: unsupported format revision {revision >> 16}.{revision & 0xFFFF}"
        )
    _check_span(path, "original-string table", orig_offset, 8 * count, size)
    _check_span(path, "translation table", trans_offset, 8 * count, size)
    if hash_size:
        _check_span(path, "hash table", hash_offset, 4 * hash_size, size)

    descriptor = struct.Struct(order + "2I")
    raw: list[tuple[bytes, bytes]] = []
    for index in range(count):
        orig_len, orig_off = descriptor.unpack_from(data, orig_offset + 8 * index)
        trans_len, trans_off = descriptor.unpack_from(data, trans_offset + 8 * index)
        _check_span(path, f"original string {index}", orig_off, orig_len, size)
        _check_span(path, f"translation {index}", trans_off, trans_len, size)
        raw.append((data[orig_off : orig_off + orig_len], data[trans_off : trans_off + trans_len]))

    header = next((msgstr for msgid, msgstr in raw if msgid == b""), b"")
    match = _CHARSET_RE.search(header)
    charset = match.group(1).decode("ascii", "replace") if match else "UTF-8"
    encoding, charset_known = charset, True
    try:
        "".encode(encoding)  # LookupError for unknown names and for non-text codecs (rot13)
    except LookupError:
        # Placeholder charsets ("CHARSET") still hold ASCII or UTF-8 in practice; any other
        # bytes then fail to decode and are counted, which is safer than guessing.
        encoding, charset_known = "utf-8", False

    messages: list[Message] = []
    counts: Counter[str] = Counter()
    for msgid_raw, msgstr_raw in raw:
        if msgid_raw == b"":
            continue  # the header entry: metadata, not a message
        counts["entries"] += 1
        context_raw: bytes | None = None
        if b"\x04" in msgid_raw:
            context_raw, msgid_raw = msgid_raw.split(b"\x04", 1)
            counts["contexts"] += 1
        plural = b"\x00" in msgid_raw
        if plural:
            counts["plurals"] += 1
            msgid_raw = msgid_raw.split(b"\x00", 1)[0]
            msgstr_raw = msgstr_raw.split(b"\x00", 1)[0]
        try:
            msgid = msgid_raw.decode(encoding)
            msgstr = msgstr_raw.decode(encoding)
            context = None if context_raw is None else context_raw.decode(encoding)
        except UnicodeDecodeError:
            counts["undecodable"] += 1
            continue
        if not msgstr:
            counts["untranslated"] += 1
        messages.append(Message(msgid, msgstr, context, plural))
    return Catalog(
        path=path,
        domain=path.stem,
        charset=charset,
        charset_known=charset_known,
        messages=tuple(messages),
        entries=counts["entries"],
        contexts=counts["contexts"],
        plurals=counts["plurals"],
        untranslated=counts["untranslated"],
        undecodable=counts["undecodable"],
    )


def _check_span(path: Path, what: str, offset: int, length: int, size: int) -> None:
    if offset + length > size:
        raise MoFormatError(
            f"{path}: {what} at offset {offset} (+{length} bytes) lies beyond the "
            f"end of the file ({size} bytes); the catalog is truncated or corrupt"
        )


def find_catalogs(locale_dir: str | os.PathLike[str], lang: str) -> list[Path]:
    """The ``.mo`` files of one language, sorted by name."""
    catalog_dir = Path(locale_dir) / lang / "LC_MESSAGES"
    if not catalog_dir.is_dir():
        return []
    return sorted(p for p in catalog_dir.iterdir() if p.suffix == ".mo" and p.is_file())
