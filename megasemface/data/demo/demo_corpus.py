"""A small, real demo corpus built from the gettext catalogs installed on a system.

Every Linux system ships human translations of short UI and command-line messages as
compiled gettext catalogs, ``<locale-dir>/<lang>/LC_MESSAGES/<domain>.mo``. Read together
they give English-to-many parallel text, monolingual text and a one-word dictionary, so the
project's demo needs no download. Layout written under the output directory::

    mono/<lang>.txt                                 one sentence per line, deduplicated
    parallel/en-<xx>/{train,valid,test}.{en,<xx>}   line-aligned sentence pairs
    dict/en-<xx>.tsv                                one-word gold dictionary, ``en<TAB>xx``
    report.json                                     what was read, dropped and kept (last)

Catalogs of names (ISO languages, countries, currencies; time zones; keyboard layouts) and
translations that copy their source up to case or punctuation are left out of every file
(message_cleaning.is_name_catalog, copies_source). The split is by catalog (domain), so test
text comes from programs never seen in training.
Short strings shared between programs ("Cancel") are then removed from train and valid
whenever either side occurs in a held-out split of any pair, and every held-out string is
left out of the monolingual files, so pre-training never sees test text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megasemface.data.demo.doc_split import (
    DEFAULT_DOC_SPLIT,
    DocSplit,
    DocSplitConfig,
    split_documentation,
)
from megasemface.data.demo.documentation import read_documentation
from megasemface.data.demo.gettext_catalogs import MoFormatError, find_catalogs, parse_mo
from megasemface.data.demo.message_cleaning import (
    DEFAULT_MAX_CHARS,
    DROP_IDENTICAL,
    NAME_CATALOGS,
    CleanResult,
    build_dictionary,
    clean_message_with_reason,
    copies_source,
    is_name_catalog,
    lowercase_words,
)
from megasemface.files import atomic_write_text

__all__ = [
    "DEFAULT_LOCALE_DIR",
    "DEFAULT_MAX_MONO_LINES",
    "DEFAULT_MIN_TEST_PAIRS",
    "DEFAULT_TEST_FRACTION",
    "DEFAULT_VALID_FRACTION",
    "SOURCE_LANG",
    "SPLITS",
    "DemoCorpusError",
    "NoCatalogsError",
    "assign_domain_splits",
    "build_demo_corpus",
    "domain_order",
    "stable_hash",
]

SOURCE_LANG = "en"
DEFAULT_LOCALE_DIR = Path("/usr/share/locale")
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_VALID_FRACTION = 0.05
DEFAULT_MIN_TEST_PAIRS = 200
DEFAULT_MAX_MONO_LINES = 300_000
"""Monolingual lines kept per language at most (a stable-hash sample beyond): bounds the data
steps (SentencePiece, shards, the cross-lingual table) whatever documentation is installed."""
SPLITS = ("train", "valid", "test")

# The test set may take at most this share of a pair, whatever --min-test-pairs asks:
# a tiny language keeps training data instead of handing it all to evaluation.
_MAX_TEST_SHARE = 0.5

_LANG_RE = re.compile(r"[A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?(?:@[A-Za-z0-9]+)?")


class DemoCorpusError(Exception):
    """The demo corpus cannot be built; the message says why and what to do."""


class NoCatalogsError(DemoCorpusError):
    """A requested language has no readable catalog under the locale directory."""


def stable_hash(text: str) -> str:
    """A hash that, unlike hash(), is the same in every process and on every machine."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def domain_order(domains: Iterable[str]) -> list[str]:
    """Domains in stable-hash order: pseudo-random, but the same on every run and machine."""
    return sorted(domains, key=lambda domain: (stable_hash(domain), domain))


def assign_domain_splits(
    sizes_by_pair: Mapping[str, Mapping[str, int]],
    *,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    min_test_pairs: int = DEFAULT_MIN_TEST_PAIRS,
) -> dict[str, str]:
    """Assigns every domain to ``test``, ``valid`` or ``train``, the same for all pairs.

    ``sizes_by_pair`` maps a pair name to its number of pairs per domain. Domains are
    taken in domain_order() and offered to test, then to valid. A domain joins a split
    when, summed over the pairs that have it (each in units of its own target), it fills
    more of what is still missing than it adds beyond the targets; with one pair: when it
    overshoots by less than the remaining need. A large program thus cannot swallow the
    training data, and the sizes reached are close to, not exactly at, the targets.

    The test target is ``test_fraction`` of a pair's pairs but at least ``min_test_pairs``,
    as long as that leaves half of them to the other splits; to reach that minimum, a
    domain also joins test while a pair that has it is short of it and no pair would go
    beyond twice its target. The valid target is ``valid_fraction`` of the pairs.

    One assignment for all pairs, rather than one per pair, is what keeps held-out text
    rare in training: the English side of a program is the same for every language, so
    per-pair choices would put it in the test set of one pair and the training set of another.
    """
    totals = {pair: sum(sizes.values()) for pair, sizes in sizes_by_pair.items()}
    minimum = {
        pair: {"test": min(min_test_pairs, math.floor(total * _MAX_TEST_SHARE)), "valid": 0}
        for pair, total in totals.items()
    }
    targets = {
        pair: {
            "test": max(math.ceil(test_fraction * total), minimum[pair]["test"]),
            "valid": math.ceil(valid_fraction * total),
        }
        for pair, total in totals.items()
    }
    filled = {pair: {"test": 0, "valid": 0} for pair in sizes_by_pair}
    assignment: dict[str, str] = {}
    for domain in domain_order({d for sizes in sizes_by_pair.values() for d in sizes}):
        present = [(p, sizes[domain]) for p, sizes in sizes_by_pair.items() if sizes.get(domain)]
        assignment[domain] = "train"
        for split in ("test", "valid"):
            gain = excess = 0.0
            for pair, size in present:
                target, done = targets[pair][split], filled[pair][split]
                if target == 0:
                    excess += 1.0  # a pair that wants no such split at all
                    continue
                gain += min(size, max(0, target - done)) / target
                excess += (max(0, done + size - target) - max(0, done - target)) / target
            short = any(filled[p][split] < minimum[p][split] for p, _ in present)
            bounded = all(filled[p][split] + n <= 2 * targets[p][split] for p, n in present)
            if gain > excess or (short and bounded):
                assignment[domain] = split
                for pair, size in present:
                    filled[pair][split] += size
                break
    return assignment


@dataclass
class _Harvest:
    """What one language's catalogs give, cleaned, before the split."""

    report: dict[str, Any]
    pairs_by_domain: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    source_text: set[str] = field(default_factory=set)
    target_text: set[str] = field(default_factory=set)


def _harvest_language(
    locale_dir: Path, lang: str, max_chars: int, cache: dict[str, CleanResult]
) -> _Harvest:
    """Reads and cleans one language's catalogs; ``cache`` is shared between languages."""

    def clean(text: str) -> CleanResult:
        # The English of a program is the same in every language: clean it once.
        result = cache.get(text)
        if result is None:
            result = cache[text] = clean_message_with_reason(text, max_chars=max_chars)
        return result

    paths = find_catalogs(locale_dir, lang)
    catalog_dir = locale_dir / lang / "LC_MESSAGES"
    if not paths:
        raise NoCatalogsError(
            f"no gettext catalogs (*.mo) for language {lang!r} in {catalog_dir}. Install "
            f"translations for {lang!r} (on Debian/Ubuntu, e.g. the language packs or "
            "packages with their locales kept), pick another language with --langs, or "
            "point --locale-dir at a directory laid out as <dir>/<lang>/LC_MESSAGES/*.mo"
        )
    counts: Counter[str] = Counter()
    pair_drops: Counter[str] = Counter()
    side_drops: dict[str, Counter[str]] = {"source": Counter(), "target": Counter()}
    broken: list[dict[str, str]] = []
    unknown_charset: list[str] = []
    duplicates: list[dict[str, str]] = []
    first_by_digest: dict[str, Path] = {}
    name_catalogs: list[str] = []
    harvest = _Harvest(report={})
    # Real files before symlinks, so that an alias (iso_639.mo -> iso_639-2.mo) is the
    # copy skipped below and the domain keeps its canonical name.
    for path in sorted(paths, key=lambda p: (p.is_symlink(), p.name)):
        if is_name_catalog(path.stem):
            name_catalogs.append(str(path))
            continue
        try:
            data = path.read_bytes()
            catalog = parse_mo(data, path=path)
        except (MoFormatError, OSError) as exc:
            broken.append({"path": str(path), "error": str(exc)})
            continue
        # A catalog installed twice under two names would otherwise give two domains with
        # the same text, which the by-catalog split could send to train and test at once.
        digest = hashlib.sha256(data).hexdigest()
        if digest in first_by_digest:
            duplicates.append({"path": str(path), "same_as": str(first_by_digest[digest])})
            continue
        first_by_digest[digest] = path
        if not catalog.charset_known:
            unknown_charset.append(str(path))
        for name in ("entries", "contexts", "plurals", "untranslated", "undecodable"):
            counts[name] += getattr(catalog, name)
        pairs = harvest.pairs_by_domain.setdefault(catalog.domain, [])
        for message in catalog.messages:
            source = clean(message.msgid)
            if source.text is None:
                side_drops["source"][str(source.reason)] += 1
            else:
                harvest.source_text.add(source.text)
            if not message.msgstr:
                continue  # untranslated: its English still feeds mono/en.txt
            target = clean(message.msgstr)
            copied = copies_source(source.text or message.msgid, target.text or message.msgstr)
            if target.text is None:
                side_drops["target"][str(target.reason)] += 1
            elif copied:
                side_drops["target"][DROP_IDENTICAL] += 1
            else:
                harvest.target_text.add(target.text)
            # Each dropped pair is counted once, under its first cause (source side first).
            if source.text is None:
                pair_drops[f"source_{source.reason}"] += 1
            elif target.text is None:
                pair_drops[f"target_{target.reason}"] += 1
            elif copied:
                pair_drops[DROP_IDENTICAL] += 1
            else:
                pairs.append((source.text, target.text))
    if len(broken) + len(name_catalogs) == len(paths):
        first = f" (first error: {broken[0]['error']})" if broken else ""
        raise NoCatalogsError(
            f"none of the {len(paths)} catalogs for {lang!r} in {catalog_dir} gives sentences: "
            f"{len(broken)} could not be read{first} and {len(name_catalogs)} list only names; "
            "install translations of programs for it or choose another language"
        )
    harvest.report = {
        "catalog_dir": str(catalog_dir),
        "catalogs_found": len(paths),
        "catalogs_read": len(paths) - len(broken) - len(duplicates) - len(name_catalogs),
        "catalogs_broken": len(broken),
        "broken_catalogs": broken,
        "name_catalogs": sorted(name_catalogs),
        "duplicate_catalogs": duplicates,
        "unknown_charset_catalogs": unknown_charset,
        **{name: counts[name] for name in ("entries", "contexts", "plurals")},
        **{name: counts[name] for name in ("untranslated", "undecodable")},
        "pair_drops": dict(sorted(pair_drops.items())),
        "side_drops": {side: dict(sorted(c.items())) for side, c in side_drops.items()},
        "pairs_kept": sum(len(p) for p in harvest.pairs_by_domain.values()),
    }
    return harvest


def _unique_pairs_by_domain(
    pairs_by_domain: Mapping[str, Sequence[tuple[str, str]]],
) -> dict[str, list[tuple[str, str]]]:
    """Each distinct pair, under the first domain (in domain_order) that has it."""
    # Split sizes are then counted on distinct pairs, and test holds no duplicates.
    seen: set[tuple[str, str]] = set()
    unique: dict[str, list[tuple[str, str]]] = {}
    for domain in domain_order(pairs_by_domain):
        unique[domain] = [p for p in dict.fromkeys(pairs_by_domain[domain]) if p not in seen]
        seen.update(unique[domain])
    return unique


def _strings(pairs: Iterable[tuple[str, str]]) -> set[str]:
    return {text for pair in pairs for text in pair}


def _remove_held_out_text(
    splits: Mapping[str, dict[str, list[tuple[str, str]]]],
) -> tuple[dict[str, dict[str, int]], set[str]]:
    """Drops from valid the pairs touching test, and from train those touching either.

    Returns the pairs removed per language and split, and all held-out strings. They are
    pooled over all pairs: the pairs and mono files are trained on together, so a test
    sentence of en-fr must not be learnt through en-de either.
    """
    removed = {lang: {"train": 0, "valid": 0} for lang in splits}
    held_out: set[str] = set().union(*(_strings(split["test"]) for split in splits.values()))
    for name in ("valid", "train"):
        for lang, split in splits.items():
            kept = [p for p in split[name] if p[0] not in held_out and p[1] not in held_out]
            removed[lang][name] = len(split[name]) - len(kept)
            split[name] = kept
        if name == "valid":  # valid, once clean of test text, is held out from train too
            held_out |= set().union(*(_strings(split["valid"]) for split in splits.values()))
    return removed, held_out


def _pair_order(pair: tuple[str, str]) -> tuple[str, tuple[str, str]]:
    return stable_hash(f"{pair[0]}\t{pair[1]}"), pair


def _line_order(line: str) -> tuple[str, str]:
    return stable_hash(line), line


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    """Writes one line per item, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(f"{line}\n" for line in lines))


def _add_documentation(
    doc_root: str | os.PathLike[str] | None,
    config: DocSplitConfig,
    langs: list[str],
    splits: dict[str, dict[str, list[tuple[str, str]]]],
    removed: dict[str, dict[str, int]],
    mono_sets: dict[str, set[str]],
) -> tuple[DocSplit, dict[str, Any] | None]:
    """Adds the documentation's text to ``mono_sets`` and, where the handbook gives them, its
    valid and test pairs to ``splits`` (the catalogs' own moved to ``*-catalogs``); train
    pairs touching any held-out sentence are removed. Returns the split and its report."""
    if doc_root is None:
        return DocSplit(), None
    docs = read_documentation(Path(doc_root), langs)
    if docs.empty:
        return DocSplit(), {"doc_root": str(doc_root), "installed": False}
    doc_split = split_documentation(docs, config)
    for lang, held_pairs in doc_split.pairs.items():
        for name in ("valid", "test"):
            splits[lang][f"{name}-catalogs"] = splits[lang][name]
            splits[lang][name] = list(dict.fromkeys(held_pairs[name]))
    for lang, split in splits.items():
        held = doc_split.held_out
        kept = [p for p in split["train"] if p[0] not in held and p[1] not in held]
        removed[lang]["train"] += len(split["train"]) - len(kept)
        split["train"] = kept
    sources: dict[str, dict[str, int]] = {}
    for lang, by_source in doc_split.mono.items():
        if lang in mono_sets:
            for sentences in by_source.values():
                mono_sets[lang].update(sentences)
            sources[lang] = {
                source: {"sentences": len(ss), "tokens": sum(len(s.split()) for s in ss)}
                for source, ss in by_source.items()
            }  # type: ignore[assignment]
    return doc_split, {
        "doc_root": str(doc_root),
        "installed": True,
        "held_out_chapters": doc_split.chapters,
        "mono_by_source": sources,
        **docs.report,
    }


def _check_options(
    langs: Sequence[str],
    max_chars: int,
    test_fraction: float,
    valid_fraction: float,
    min_test_pairs: int,
    max_mono_lines: int,
) -> None:
    if not langs:
        raise ValueError("no target language given")
    for lang in langs:
        if lang == SOURCE_LANG:
            raise ValueError(f"{SOURCE_LANG!r} is the source language; list target languages only")
        if not _LANG_RE.fullmatch(lang):
            raise ValueError(f"invalid language code {lang!r} (expected e.g. de, pt_BR, sr@latin)")
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if max_mono_lines < 1:
        raise ValueError(f"max_mono_lines must be >= 1, got {max_mono_lines}")
    if min_test_pairs < 0:
        raise ValueError(f"min_test_pairs must be >= 0, got {min_test_pairs}")
    for name, value in (("test_fraction", test_fraction), ("valid_fraction", valid_fraction)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    if test_fraction + valid_fraction >= 1.0:
        raise ValueError("test_fraction + valid_fraction must leave room for training data")


def build_demo_corpus(
    locale_dir: str | os.PathLike[str],
    langs: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    min_test_pairs: int = DEFAULT_MIN_TEST_PAIRS,
    doc_root: str | os.PathLike[str] | None = None,
    doc_split: DocSplitConfig = DEFAULT_DOC_SPLIT,
    max_mono_lines: int = DEFAULT_MAX_MONO_LINES,
) -> dict[str, Any]:
    """Builds the demo corpus of en-<lang> pairs under ``out_dir`` and returns its report.

    With ``doc_root`` (``/usr/share``), the Debian documentation installed under it adds
    monolingual text, and where the Debian Administrator's Handbook is translated into a
    language, its held-out chapters' ordinary sentence pairs are that pair's valid and test
    sets; the catalogs' own are then written as ``{valid,test}-catalogs.<lang>``.

    Raises ValueError for invalid options and NoCatalogsError when a language has no
    readable catalog, both before anything is written. Every file is replaced atomically
    and report.json, removed first, is written last: a corpus without it is incomplete.
    The same inputs and options always give byte-identical files.
    """
    langs = list(dict.fromkeys(langs))
    _check_options(langs, max_chars, test_fraction, valid_fraction, min_test_pairs, max_mono_lines)
    locale_dir, out_dir = Path(locale_dir), Path(out_dir)
    cache: dict[str, CleanResult] = {}
    harvests = {lang: _harvest_language(locale_dir, lang, max_chars, cache) for lang in langs}

    unique = {lang: _unique_pairs_by_domain(h.pairs_by_domain) for lang, h in harvests.items()}
    assignment = assign_domain_splits(
        {
            lang: {d: len(pairs) for d, pairs in by_domain.items()}
            for lang, by_domain in unique.items()
        },
        test_fraction=test_fraction,
        valid_fraction=valid_fraction,
        min_test_pairs=min_test_pairs,
    )
    splits: dict[str, dict[str, list[tuple[str, str]]]] = {}
    split_domains: dict[str, dict[str, list[str]]] = {}
    for lang, by_domain in unique.items():
        splits[lang] = {split: [] for split in SPLITS}
        split_domains[lang] = {split: [] for split in SPLITS}
        for domain in sorted(by_domain):
            splits[lang][assignment[domain]].extend(by_domain[domain])
            split_domains[lang][assignment[domain]].append(domain)
    removed, held_out = _remove_held_out_text(splits)
    mono_sets = {SOURCE_LANG: set().union(*(h.source_text for h in harvests.values()))}
    mono_sets.update({lang: harvest.target_text for lang, harvest in harvests.items()})
    held_docs, doc_report = _add_documentation(
        doc_root, doc_split, langs, splits, removed, mono_sets
    )
    held_out |= held_docs.held_out

    # An existing report would vouch for a corpus this run is about to half-rewrite.
    (out_dir / "report.json").unlink(missing_ok=True)
    mono_report: dict[str, Any] = {}
    for lang, texts in mono_sets.items():
        lines = sorted(texts - held_out, key=_line_order)
        path = Path("mono", f"{lang}.txt")
        _write_lines(out_dir / path, lines[:max_mono_lines])
        mono_report[lang] = {
            "file": str(path),
            "lines": min(len(lines), max_mono_lines),
            "removed_held_out": len(texts) - len(lines),
            "left_out_over_cap": max(0, len(lines) - max_mono_lines),
            "tokens": sum(len(line.split()) for line in lines[:max_mono_lines]),
        }

    common_words = lowercase_words(mono_sets[SOURCE_LANG])
    pair_report: dict[str, Any] = {}
    for lang, split in splits.items():
        pair = f"{SOURCE_LANG}-{lang}"
        for name, pairs in split.items():
            pairs.sort(key=_pair_order)
            for side, lang_code in enumerate((SOURCE_LANG, lang)):
                path = out_dir / "parallel" / pair / f"{name}.{lang_code}"
                _write_lines(path, (p[side] for p in pairs))
        all_pairs = {p for pairs in harvests[lang].pairs_by_domain.values() for p in pairs}
        entries = build_dictionary(all_pairs, common_words)
        _write_lines(out_dir / "dict" / f"{pair}.tsv", (f"{s}\t{t}" for s, t in entries))
        pair_report[pair] = {
            "directory": str(Path("parallel", pair)),
            "unique_pairs": len(all_pairs),
            "duplicates_removed": harvests[lang].report["pairs_kept"] - len(all_pairs),
            "split_sizes": {name: len(pairs) for name, pairs in split.items()},
            "removed_for_leakage": removed[lang],
            "split_domains": split_domains[lang],
            "dictionary": {"file": str(Path("dict", f"{pair}.tsv")), "entries": len(entries)},
            "held_out_from": "debian_handbook" if lang in held_docs.pairs else "catalogs",
        }

    report: dict[str, Any] = {
        "locale_dir": str(locale_dir),
        "source_lang": SOURCE_LANG,
        "options": {
            "langs": langs,
            "max_chars": max_chars,
            "test_fraction": test_fraction,
            "valid_fraction": valid_fraction,
            "min_test_pairs": min_test_pairs,
            "doc_root": None if doc_root is None else str(doc_root),
            "doc_split": dataclasses.asdict(doc_split),
            "max_mono_lines": max_mono_lines,
            "name_catalogs_left_out": list(NAME_CATALOGS),
        },
        "languages": {lang: harvest.report for lang, harvest in harvests.items()},
        "pairs": pair_report,
        "mono": mono_report,
        "documentation": doc_report,
    }
    _write_lines(out_dir / "report.json", [json.dumps(report, indent=2, ensure_ascii=False)])
    return report
