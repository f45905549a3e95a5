"""Tests of the demo corpus built from gettext catalogs, on .mo files written byte by byte."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megasemface.cli.make_demo_corpus import main
from megasemface.data.demo.demo_corpus import (
    NoCatalogsError,
    assign_domain_splits,
    build_demo_corpus,
)
from megasemface.data.demo.gettext_catalogs import Message, MoFormatError, read_mo
from megasemface.data.demo.message_cleaning import (
    DROP_CONTROL_CHARS,
    DROP_MULTILINE,
    DROP_NO_LETTERS,
    DROP_TOO_LONG,
    DROP_URL_PATH_EMAIL,
    build_dictionary,
    clean_message,
    clean_message_with_reason,
    copies_source,
    is_name_catalog,
    lowercase_words,
    strip_accelerators,
)

REPO = Path(__file__).resolve().parents[1]
SYSTEM_LOCALE_DIR = Path("/usr/share/locale")
MAGIC = 0x950412DE


def mo_bytes(
    entries: dict[bytes, bytes],
    *,
    charset: str | None = "UTF-8",
    big_endian: bool = False,
    revision: int = 0,
) -> bytes:
    """A gettext .mo file as msgfmt lays it out: header, two descriptor tables, strings."""
    items = dict(entries)
    if charset is not None:
        items[b""] = f"Content-Type: text/plain; charset={charset}\nLanguage: xx\n".encode()
    ordered = sorted(items.items())  # msgfmt sorts by msgid; the header ("") comes first
    order = ">" if big_endian else "<"
    count = len(ordered)
    orig_table, trans_table = 28, 28 + 8 * count
    strings_at = 28 + 16 * count
    blob = bytearray()
    descriptors: list[list[tuple[int, int]]] = [[], []]
    for side in (0, 1):
        for item in ordered:
            descriptors[side].append((len(item[side]), strings_at + len(blob)))
            blob += item[side] + b"\x00"
    header = struct.pack(order + "7I", MAGIC, revision, count, orig_table, trans_table, 0, 0)
    tables = b"".join(struct.pack(order + "2I", *d) for side in descriptors for d in side)
    return header + tables + bytes(blob)


def write_mo(locale_dir: Path, lang: str, domain: str, data: bytes) -> Path:
    path = locale_dir / lang / "LC_MESSAGES" / f"{domain}.mo"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return text.splitlines()


def assert_nowhere_in_training(corpus: Path, held_out: set[str], lang: str = "de") -> None:
    """No held-out sentence in the monolingual files or the training pairs, read from disk."""
    for side in ("en", lang):
        for path in (f"mono/{side}.txt", f"parallel/en-{lang}/train.{side}"):
            assert not set(lines(corpus / path)) & held_out, path


LATIN1_ENTRIES = {
    b"Preferences": "Préférences".encode("latin-1"),
    b"menu\x04Quit": b"Quitter",
    b"%d file\x00%d files": b"%d fichier\x00%d fichiers",
    b"Untranslated message": b"",
    b"_Save As": b"_Enregistrer sous",
    b"See https://example.org for help": b"Voir https://example.org pour de l'aide",
    b"Linux": b"Linux",
    b"Line one\nLine two": b"Ligne un\nLigne deux",
    b"---": b"---",
    b"Close": b"Fermer\nmaintenant",
}
LATIN1_MESSAGES = [  # in msgid byte order, as stored
    Message("%d file", "%d fichier", plural=True),
    Message("---", "---"),
    Message("Close", "Fermer\nmaintenant"),
    Message("Line one\nLine two", "Ligne un\nLigne deux"),
    Message("Linux", "Linux"),
    Message("Preferences", "Préférences"),
    Message("See https://example.org for help", "Voir https://example.org pour de l'aide"),
    Message("Untranslated message", ""),
    Message("_Save As", "_Enregistrer sous"),
    Message("Quit", "Quitter", context="menu"),
]
UTF8_ENTRIES = {
    b"Open": b"Ouvrir",
    b"Delete": b"Supprimer",
    b"Cannot open or delete the file": "Impossible d’ouvrir ou de supprimer le fichier".encode(),
}


def test_read_mo_decodes_a_latin1_catalog_exactly(tmp_path: Path) -> None:
    path = write_mo(tmp_path, "fr", "demo", mo_bytes(LATIN1_ENTRIES, charset="ISO-8859-1"))
    catalog = read_mo(path)
    assert (catalog.domain, catalog.charset, catalog.charset_known) == ("demo", "ISO-8859-1", True)
    assert list(catalog.messages) == LATIN1_MESSAGES
    assert (catalog.entries, catalog.contexts, catalog.plurals) == (10, 1, 1)
    assert (catalog.untranslated, catalog.undecodable) == (1, 0)


def test_read_mo_reads_big_endian_and_revision_1(tmp_path: Path) -> None:
    data = mo_bytes(UTF8_ENTRIES, big_endian=True, revision=1 << 16 | 1)
    catalog = read_mo(write_mo(tmp_path, "fr", "other", data))
    assert catalog.charset == "UTF-8"
    assert {(m.msgid, m.msgstr) for m in catalog.messages} == {
        (k.decode(), v.decode()) for k, v in UTF8_ENTRIES.items()
    }


def test_read_mo_counts_unknown_charset_and_undecodable_strings(tmp_path: Path) -> None:
    data = mo_bytes({b"Good": b"Gut", b"Bad": b"\xff\xfe"}, charset="X-NO-SUCH-CHARSET")
    catalog = read_mo(write_mo(tmp_path, "de", "odd", data))
    assert (catalog.charset, catalog.charset_known) == ("X-NO-SUCH-CHARSET", False)
    assert list(catalog.messages) == [Message("Good", "Gut")]
    assert (catalog.entries, catalog.undecodable) == (2, 1)
    # No header at all: UTF-8, as gettext assumes.
    catalog = read_mo(
        write_mo(tmp_path, "de", "bare", mo_bytes({b"A": "Ä".encode()}, charset=None))
    )
    assert (catalog.charset, catalog.charset_known, catalog.messages) == (
        "UTF-8",
        True,
        (Message("A", "Ä"),),
    )


def _corrupt(kind: str) -> bytes:
    good = mo_bytes(UTF8_ENTRIES)
    if kind == "bad magic":
        return b"\x00\x00\x00\x00" + good[4:]
    if kind == "short header":
        return good[:20]
    if kind == "truncated strings":
        return good[:-10]
    if kind == "table out of range":
        return good[:12] + struct.pack("<I", len(good)) + good[16:]
    if kind == "huge count":
        return good[:8] + struct.pack("<I", 1 << 30) + good[12:]
    if kind == "revision 2":
        return good[:4] + struct.pack("<I", 2 << 16) + good[8:]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "bad magic",
        "short header",
        "truncated strings",
        "table out of range",
        "huge count",
        "revision 2",
    ],
)
def test_read_mo_rejects_broken_catalogs(tmp_path: Path, kind: str) -> None:
    path = write_mo(tmp_path, "fr", "broken", _corrupt(kind))
    with pytest.raises(MoFormatError, match=r"broken\.mo"):
        read_mo(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("_File", "File"),
        ("&File", "File"),
        ("Save &As", "Save As"),
        ("Save _As...", "Save As..."),
        ("ファイル(_F)", "ファイル"),
        ("打开 (&O)...", "打开..."),
        ("file_name", "file_name"),
        ("_NET_WM_NAME", "_NET_WM_NAME"),
        ("__init__", "__init__"),
        ("Tom &amp; Jerry", "Tom &amp; Jerry"),
        ("R&&D", "R&&D"),
        ("_One or _Two", "_One or _Two"),  # two markers: ambiguous, left alone
        ("Rock & roll", "Rock & roll"),
        ("E_xit", "E_xit"),  # mid-word: could be an identifier, left alone
    ],
)
def test_strip_accelerators(text: str, expected: str) -> None:
    assert strip_accelerators(text) == expected


@pytest.mark.parametrize(
    ("text", "expected", "reason"),
    [
        ("  _Open   the\tfile ", "Open the file", None),
        ("Fichier\u00a0:", "Fichier\u00a0:", None),  # typographic no-break space is kept
        ("line one\nline two", None, DROP_MULTILINE),
        ("a\r", None, DROP_MULTILINE),
        ("%d / %d", None, DROP_NO_LETTERS),  # placeholders are not text
        ("%s: %(name)s {0}", None, DROP_NO_LETTERS),
        ("%d files", "%d files", None),
        ("", None, DROP_NO_LETTERS),
        ("\x1b[1mbold", None, DROP_CONTROL_CHARS),
        ("x" * 201, None, DROP_TOO_LONG),
        ("Visit https://example.org now", None, DROP_URL_PATH_EMAIL),
        ("see www.gnu.org", None, DROP_URL_PATH_EMAIL),
        ("Report bugs to bug-coreutils@gnu.org", None, DROP_URL_PATH_EMAIL),
        ("cannot open /etc/passwd", None, DROP_URL_PATH_EMAIL),
        ("run ./configure first", None, DROP_URL_PATH_EMAIL),
        ("and/or 1/2 KB/s", "and/or 1/2 KB/s", None),
    ],
)
def test_clean_message(text: str, expected: str | None, reason: str | None) -> None:
    clean = clean_message_with_reason(text)
    assert (clean.text, clean.reason) == (expected, reason)
    assert clean_message(text) == expected


def test_clean_message_max_chars() -> None:
    assert clean_message("x" * 10, max_chars=10) == "x" * 10
    assert clean_message_with_reason("x" * 11, max_chars=10).reason == DROP_TOO_LONG


def test_build_dictionary_keeps_one_word_common_entries() -> None:
    pairs = [
        ("Open", "Öffnen"),
        ("File", "Datei"),
        ("Abkhazian", "Abchasisch"),  # never lower case in English: a name
        ("Open file", "Datei öffnen"),  # two words
        ("Email", "E-Mail"),
        ("Files", "Dateien"),
        ("About", "About"),  # a copy, not a translation
        ("Bytes", "%s Bytes"),
    ]
    common = lowercase_words(["cannot open file", "email about bytes", "Abkhazian"])
    assert build_dictionary(pairs, common) == [
        ("email", "e-mail"),
        ("file", "datei"),
        ("open", "öffnen"),
    ]
    assert build_dictionary([("add", "ઉમેરો")], {"add"}) == [("add", "ઉમેરો")]


@pytest.mark.parametrize(
    ("source", "target", "copied"),
    [
        ("Linux", "Linux", True),
        ("socket", "Socket", True),
        ("Password:", "Password", True),
        ("E-mail", "Email", True),
        ("Tab Width", "Tab width:", True),
        ("RETURN", "Return", True),
        ("%s: %s", "%s : %s", True),
        ("Straße", "STRASSE", True),  # case folding: ß is ss
        ("Password:", "Passwort:", False),
        ("MTU:%d Metric:%d", "MTU:%d Metrik:%d", False),
        ("Guarani", "Guaraní", False),  # an accent is a change of spelling
        ("%d file", "%d Datei", False),
        ("Page 1", "Page 2", False),
    ],
)
def test_copies_source_is_equality_up_to_case_and_punctuation(
    source: str, target: str, copied: bool
) -> None:
    assert copies_source(source, target) is copied


@pytest.mark.parametrize(
    ("domain", "names"),
    [
        ("iso_3166", True),
        ("iso_3166-2", True),
        ("iso_3166_2", True),
        ("iso_639-3", True),
        ("iso_4217", True),
        ("iso_15924", True),
        ("tzdata", True),
        ("libgweather-locations", True),
        ("xkeyboard-config", True),
        ("coreutils", False),
        ("gtk20", False),
        ("shared-mime-info", False),
        ("isoquery", False),
    ],
)
def test_is_name_catalog(domain: str, names: bool) -> None:
    assert is_name_catalog(domain) is names


def test_names_and_copies_are_left_out_of_every_file(tmp_path: Path) -> None:
    """Entries as the system's catalogs hold them: region and language names beside
    programs whose translators left some strings as they are."""
    locale_dir, out = tmp_path / "locale", tmp_path / "out"
    for d in range(12):
        entries = {
            f"Cannot read message {i} of program {d}".encode(): (
                f"Nachricht {i} von Programm {d} kann nicht gelesen werden".encode()
            )
            for i in range(8)
        }
        entries[b"Linux"] = b"Linux"
        entries[f"socket{d}".encode()] = f"Socket{d}".encode()
        entries[f"Options of program {d}:".encode()] = f"options of program {d}".encode()
        write_mo(locale_dir, "de", f"prog{d:02d}", mo_bytes(entries))
    write_mo(
        locale_dir,
        "de",
        "iso_3166-2",
        mo_bytes({b"Bavaria": b"Bayern", b"Berlin": b"Berlin", b"Hesse": b"Hessen"}),
    )
    write_mo(locale_dir, "de", "iso_639-3", mo_bytes({b"German": b"Deutsch"}))
    (locale_dir / "de/LC_MESSAGES/iso_639.mo").symlink_to("iso_639-3.mo")
    options = {"test_fraction": 0.2, "valid_fraction": 0.2, "min_test_pairs": 0}
    report = build_demo_corpus(locale_dir, ["de"], out, **options)
    de = report["languages"]["de"]
    catalogs = locale_dir / "de/LC_MESSAGES"
    assert de["name_catalogs"] == [
        str(catalogs / f) for f in ("iso_3166-2.mo", "iso_639-3.mo", "iso_639.mo")
    ]
    assert de["catalogs_read"] == 12
    assert de["pair_drops"] == {"identical": 36}
    domains = report["pairs"]["en-de"]["split_domains"]
    assert all(domains[split] for split in ("train", "valid", "test"))
    assert not [d for split in domains.values() for d in split if d.startswith("iso")]
    texts = [
        line
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name != "report.json"
        for line in lines(path)
    ]
    assert len(texts) > 12 * 8
    for text in texts:
        assert not any(word in text for word in ("Bavaria", "Bayern", "Hesse", "Berlin", "Deutsch"))
    # A copy is no translation, but its English is still English text.
    assert "Linux" in lines(out / "mono/en.txt")
    for path in [
        *sorted(out.glob("parallel/en-de/*")),
        out / "mono/de.txt",
        out / "dict/en-de.tsv",
    ]:
        for text in lines(path):
            assert not any(word in text.lower() for word in ("linux", "socket", "options of")), path
    # A language with catalogs of names only has nothing to translate.
    write_mo(locale_dir, "fr", "iso_3166-2", mo_bytes({b"Bavaria": "Bavière".encode()}))
    with pytest.raises(NoCatalogsError, match="0 could not be read and 1 list only names"):
        build_demo_corpus(locale_dir, ["fr"], tmp_path / "fr")


def _small_locale(locale_dir: Path) -> Path:
    write_mo(locale_dir, "fr", "demo", mo_bytes(LATIN1_ENTRIES, charset="ISO-8859-1"))
    write_mo(locale_dir, "fr", "other", mo_bytes(UTF8_ENTRIES, big_endian=True))
    return write_mo(locale_dir, "fr", "broken", mo_bytes(UTF8_ENTRIES)[:-7])


def test_build_counts_every_drop_and_writes_the_layout(tmp_path: Path) -> None:
    locale_dir, out = tmp_path / "locale", tmp_path / "out"
    broken = _small_locale(locale_dir)
    report = build_demo_corpus(
        locale_dir, ["fr"], out, test_fraction=0.0, valid_fraction=0.0, min_test_pairs=0
    )
    fr = report["languages"]["fr"]
    assert (fr["catalogs_found"], fr["catalogs_read"], fr["catalogs_broken"]) == (3, 2, 1)
    assert [b["path"] for b in fr["broken_catalogs"]] == [str(broken)]
    assert (fr["entries"], fr["contexts"], fr["plurals"]) == (13, 1, 1)
    assert (fr["untranslated"], fr["undecodable"]) == (1, 0)
    assert fr["pair_drops"] == {
        "identical": 1,
        "source_multiline": 1,
        "source_no_letters": 1,
        "source_url_path_email": 1,
        "target_multiline": 1,
    }
    assert fr["side_drops"]["source"] == {"multiline": 1, "no_letters": 1, "url_path_email": 1}
    assert fr["pairs_kept"] == 7

    expected_pairs = {
        ("Preferences", "Préférences"),
        ("Quit", "Quitter"),
        ("%d file", "%d fichier"),
        ("Save As", "Enregistrer sous"),
        ("Open", "Ouvrir"),
        ("Delete", "Supprimer"),
        ("Cannot open or delete the file", "Impossible d’ouvrir ou de supprimer le fichier"),
    }
    train = list(
        zip(
            lines(out / "parallel/en-fr/train.en"),
            lines(out / "parallel/en-fr/train.fr"),
            strict=True,
        )
    )
    assert set(train) == expected_pairs and len(train) == len(expected_pairs)
    for split in ("valid", "test"):
        assert (
            lines(out / f"parallel/en-fr/{split}.en")
            == lines(out / f"parallel/en-fr/{split}.fr")
            == []
        )
    en = lines(out / "mono/en.txt")
    assert set(en) == {s for s, _ in expected_pairs} | {"Untranslated message", "Linux", "Close"}
    # Stable-hash order, so that neighbouring lines come from different programs.
    assert en == sorted(en, key=lambda line: hashlib.sha256(line.encode()).hexdigest())
    assert set(lines(out / "mono/fr.txt")) == {t for _, t in expected_pairs}
    # "open" and "delete" occur in lower case in English text; "Preferences" and "Quit" never.
    assert lines(out / "dict/en-fr.tsv") == ["delete\tsupprimer", "open\touvrir"]
    assert json.loads((out / "report.json").read_text(encoding="utf-8")) == report
    assert report["options"]["langs"] == ["fr"] and report["locale_dir"] == str(locale_dir)
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def _big_locale(locale_dir: Path) -> None:
    """Two languages, 40 programs each; some strings are shared between programs."""
    words = {"de": "Eintrag", "fr": "Entrée"}
    for lang, word in words.items():
        for d in range(40):
            entries = {
                f"Entry {d}-{i} of program {d}".encode(): f"{word} {d}-{i} von {d}".encode()
                for i in range(10 + d % 7)
            }
            entries[b"Cancel"] = {"de": "Abbrechen", "fr": "Annuler"}[lang].encode()
            # The same English, translated differently by each program.
            entries[b"Close window"] = f"{word} schliessen {d}".encode()
            write_mo(locale_dir, lang, f"prog{d:02d}", mo_bytes(entries, big_endian=d % 2 == 1))
    alias = locale_dir / "de" / "LC_MESSAGES" / "prog00-alias.mo"
    alias.symlink_to("prog00.mo")


def test_split_is_by_catalog_and_nothing_held_out_leaks(tmp_path: Path) -> None:
    locale_dir = tmp_path / "locale"
    _big_locale(locale_dir)
    options = {"test_fraction": 0.1, "valid_fraction": 0.1, "min_test_pairs": 60}
    report = build_demo_corpus(locale_dir, ["de", "fr"], tmp_path / "a", **options)
    assert report["languages"]["de"]["duplicate_catalogs"] == [
        {
            "path": str(locale_dir / "de/LC_MESSAGES/prog00-alias.mo"),
            "same_as": str(locale_dir / "de/LC_MESSAGES/prog00.mo"),
        }
    ]
    out = tmp_path / "a"
    held_out: set[str] = set()
    test_only: set[str] = set()
    for lang in ("de", "fr"):
        info = report["pairs"][f"en-{lang}"]
        domains = info["split_domains"]
        assert not set(domains["test"]) & (set(domains["train"]) | set(domains["valid"]))
        assert not set(domains["valid"]) & set(domains["train"])
        assert info["split_sizes"]["test"] >= 60
        assert info["split_sizes"]["valid"] > 0
        assert info["removed_for_leakage"]["train"] > 0  # "Cancel" and "Close window"
        for side in ("en", lang):
            test_only |= set(lines(out / f"parallel/en-{lang}/test.{side}"))
            held_out |= set(lines(out / f"parallel/en-{lang}/valid.{side}"))
    held_out |= test_only
    # One split of programs for all pairs: a program's English is held out everywhere.
    assert report["pairs"]["en-de"]["split_domains"] == report["pairs"]["en-fr"]["split_domains"]
    for lang in ("de", "fr"):
        for side in ("en", lang):
            assert not set(lines(out / f"parallel/en-{lang}/train.{side}")) & held_out
            assert not set(lines(out / f"parallel/en-{lang}/valid.{side}")) & test_only
    for lang in ("en", "de", "fr"):
        mono = lines(out / f"mono/{lang}.txt")
        assert mono and len(mono) == len(set(mono)) and not set(mono) & held_out
        assert report["mono"][lang]["removed_held_out"] > 0
    # The same inputs give the same bytes.
    build_demo_corpus(locale_dir, ["de", "fr"], tmp_path / "b", **options)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file()
    )
    assert all((out / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_assign_domain_splits_reaches_the_targets_without_big_domains() -> None:
    sizes = {f"small{i}": 10 for i in range(100)} | {"huge": 5000}
    assignment = assign_domain_splits(
        {"en-xx": sizes}, test_fraction=0.02, valid_fraction=0.01, min_test_pairs=150
    )
    assert assignment == assign_domain_splits(
        {"en-xx": dict(reversed(sizes.items()))},
        test_fraction=0.02,
        valid_fraction=0.01,
        min_test_pairs=150,
    )
    filled = {
        split: sum(sizes[d] for d, s in assignment.items() if s == split)
        for split in ("test", "valid")
    }
    assert assignment["huge"] == "train"
    assert 150 <= filled["test"] < 150 + 10  # max(2% of 6000, 150)
    assert 60 <= filled["valid"] < 60 + 10
    # A language too small for --min-test-pairs keeps half of its pairs out of test.
    small = assign_domain_splits({"en-yy": {f"d{i}": 10 for i in range(10)}}, min_test_pairs=200)
    assert sum(10 for split in small.values() if split == "test") == 50


def test_main_fails_clearly_on_an_empty_locale_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "locale").mkdir()
    out = tmp_path / "out"
    assert main(["--locale-dir", str(tmp_path / "locale"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no gettext catalogs" in err and str(tmp_path / "locale" / "de" / "LC_MESSAGES") in err
    assert "--locale-dir" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(NoCatalogsError):
        build_demo_corpus(tmp_path / "locale", ["de"], out)


def test_main_rejects_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--langs", "en", "--out", str(tmp_path)]) == 2
    assert "source language" in capsys.readouterr().err
    assert main(["--test-fraction", "1.5"]) == 2


def test_main_and_tool_script_build_a_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locale_dir, out = tmp_path / "locale", tmp_path / "out"
    _small_locale(locale_dir)
    (out / "report.json").parent.mkdir(parents=True)
    (out / "report.json").write_text("{stale}")
    assert main(["--locale-dir", str(locale_dir), "--langs", "fr", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "en-fr" in stdout and str(out) in stdout
    assert json.loads((out / "report.json").read_text())["options"]["langs"] == ["fr"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "tools/make_demo_corpus.py", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "--locale-dir" in done.stdout


def test_an_interrupted_run_leaves_no_report_and_no_temp_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locale_dir, out = tmp_path / "locale", tmp_path / "out"
    _small_locale(locale_dir)
    (out / "parallel/en-fr/train.fr").mkdir(parents=True)  # a directory where a file must go
    (out / "report.json").write_text("{}")  # from an earlier, complete run
    assert main(["--locale-dir", str(locale_dir), "--langs", "fr", "--out", str(out)]) == 1
    assert "train.fr" in capsys.readouterr().err
    assert (out / "mono/en.txt").is_file() and not (out / "report.json").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.skipif(
    not any((SYSTEM_LOCALE_DIR / "de" / "LC_MESSAGES").glob("*.mo")),
    reason=f"no German gettext catalogs in {SYSTEM_LOCALE_DIR}/de/LC_MESSAGES on this system",
)
def test_real_system_catalogs_give_a_usable_corpus(tmp_path: Path) -> None:
    report = build_demo_corpus(SYSTEM_LOCALE_DIR, ["de"], tmp_path)
    sizes = report["pairs"]["en-de"]["split_sizes"]
    assert sizes["train"] > 1000 and sizes["test"] > 200 and sizes["valid"] > 0
    test = set(lines(tmp_path / "parallel/en-de/test.en")) | set(
        lines(tmp_path / "parallel/en-de/test.de")
    )
    assert_nowhere_in_training(tmp_path, test)
    assert len(lines(tmp_path / "dict/en-de.tsv")) > 100
    domains = report["pairs"]["en-de"]["split_domains"]
    assert not [d for split in domains.values() for d in split if is_name_catalog(d)]
    for split in ("train", "valid", "test"):
        pairs = zip(
            lines(tmp_path / f"parallel/en-de/{split}.en"),
            lines(tmp_path / f"parallel/en-de/{split}.de"),
            strict=True,
        )
        assert not [p for p in pairs if copies_source(*p)], split


_CHAPTER_WORDS = ("red", "green", "blue", "brown", "black", "white")
_GERMAN_WORDS = {"red": "rot", "green": "grün", "blue": "blau", "brown": "braun"}
_GERMAN_WORDS |= {"black": "schwarz", "white": "weiss"}


def _handbook_page(title: str, paragraphs: list[str]) -> str:
    body = "".join(f'<div class="para">{p}</div><pre>make all</pre>' for p in paragraphs)
    return f"<html><head><title>{title}</title></head><body>{body}</body></html>"


def _doc_root(root: Path) -> None:
    """A handbook of six chapters in English and German, a German man page and its English
    original: what debian-handbook and manpages-de install, in small."""
    for number, word in enumerate(_CHAPTER_WORDS, start=1):
        german = _GERMAN_WORDS[word]
        en = [
            f"The {word} machine reads every {thing}. A {word} user writes {kind} letters."
            for thing, kind in (("book", "short"), ("page", "long"), ("note", "kind"))
        ]
        de = [
            f"Die {german} Maschine liest jedes {thing}. Ein {german} Benutzer schreibt {kind} "
            "Briefe."
            for thing, kind in (("Buch", "kurze"), ("Blatt", "lange"), ("Heft", "nette"))
        ]
        for lang_dir, title, paragraphs in (
            ("en-US", f"Chapter {number}. The {word} one", en),
            ("de-DE", f"Kapitel {number}. Das {german}e", de),
        ):
            path = root / "doc/debian-handbook/html" / lang_dir / f"chapter-{word}.html"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_handbook_page(title, paragraphs), encoding="utf-8")
    for directory, text in (
        ("man/man1", "Every page of this manual explains the program."),
        ("man/de/man1", "Jede Seite dieses Handbuchs erklärt das Programm."),
    ):
        page = root / directory / "demo.1"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f".TH DEMO 1\n.SH DESCRIPTION\n{text}\n", encoding="utf-8")


def test_documentation_gives_prose_valid_and_test_sets_kept_out_of_training(
    tmp_path: Path,
) -> None:
    from megasemface.data.demo.doc_split import DocSplitConfig

    locale_dir, doc_root, out = tmp_path / "locale", tmp_path / "share", tmp_path / "out"
    _big_locale(locale_dir)
    _doc_root(doc_root)
    split = DocSplitConfig(test_pairs=6, test_fraction=0.3, valid_fraction=0.1, min_pairs=10)
    report = build_demo_corpus(locale_dir, ["de"], out, doc_root=doc_root, doc_split=split)
    info = report["pairs"]["en-de"]
    assert info["held_out_from"] == "debian_handbook"
    chapters = report["documentation"]["held_out_chapters"]
    assert (
        chapters["test"]
        and chapters["valid"]
        and not set(chapters["test"]) & set(chapters["valid"])
    )
    held: set[str] = set()
    for name in ("valid", "test"):
        en = lines(out / f"parallel/en-de/{name}.en")
        de = lines(out / f"parallel/en-de/{name}.de")
        assert len(en) == len(de) == 6 * len(chapters[name])  # 3 paragraphs of 2 sentences
        assert all(s.startswith(("The ", "A ")) for s in en)
        held |= set(en) | set(de)
        # The catalogs' own held-out pairs stay, as a second test set.
        assert lines(out / f"parallel/en-de/{name}-catalogs.en")
    # No held-out sentence in any monolingual or training file, checked on the files.
    assert_nowhere_in_training(out, held)
    mono_en, mono_de = set(lines(out / "mono/en.txt")), set(lines(out / "mono/de.txt"))
    assert "Every page of this manual explains the program." in mono_en
    assert "Jede Seite dieses Handbuchs erklärt das Programm." in mono_de
    # The chapters not held out are monolingual text, in both languages.
    held_chapters = {chapter for names in chapters.values() for chapter in names}
    kept = [w for n, w in enumerate(_CHAPTER_WORDS, start=1) if str(n) not in held_chapters]
    assert kept and f"The {kept[0]} machine reads every book." in mono_en
    assert f"Die {_GERMAN_WORDS[kept[0]]} Maschine liest jedes Buch." in mono_de


def test_demo_says_in_one_line_that_it_runs_on_the_catalogs_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megasemface.pipeline.config import PipelineConfig
    from megasemface.pipeline.data_steps import build_corpus

    _big_locale(tmp_path / "locale")
    (tmp_path / "share").mkdir()
    config = PipelineConfig(
        workdir=tmp_path / "work", locale_dir=tmp_path / "locale", doc_root=tmp_path / "share"
    )
    corpus = build_corpus(config)
    notices = [line for line in capsys.readouterr().out.splitlines() if "documentation" in line]
    assert notices == [
        f"no Debian documentation under {tmp_path / 'share'}: the corpus is the gettext "
        "catalogs alone (apt-get install debian-handbook manpages-de manpages-fr "
        "debian-reference-en debian-reference-de debian-reference-fr adds text and a prose "
        "test set)"
    ]
    report = json.loads((corpus / "report.json").read_text())
    assert report["pairs"]["en-de"]["held_out_from"] == "catalogs"
    assert not (corpus / "parallel/en-de/test-catalogs.en").exists()


@pytest.mark.skipif(
    not Path("/usr/share/doc/debian-handbook/html/de-DE").is_dir()
    or not any((SYSTEM_LOCALE_DIR / "de" / "LC_MESSAGES").glob("*.mo")),
    reason="the German handbook (debian-handbook) or German gettext catalogs are not installed",
)
def test_real_handbook_gives_prose_on_which_copying_scores_little(tmp_path: Path) -> None:
    import sacrebleu

    report = build_demo_corpus(SYSTEM_LOCALE_DIR, ["de"], tmp_path, doc_root="/usr/share")
    info = report["pairs"]["en-de"]
    assert info["held_out_from"] == "debian_handbook"
    assert info["split_sizes"]["test"] >= 1000 and info["split_sizes"]["valid"] >= 200
    held: set[str] = set()
    for split in ("valid", "test"):
        en = lines(tmp_path / f"parallel/en-de/{split}.en")
        de = lines(tmp_path / f"parallel/en-de/{split}.de")
        # Copying the source: about 13.8 BLEU on the catalogs' software messages.
        assert sacrebleu.corpus_bleu(en, [de]).score < 7, split
        held |= set(en) | set(de)
    assert_nowhere_in_training(tmp_path, held)
    for lang in ("en", "de"):
        assert report["mono"][lang]["lines"] > 50_000
