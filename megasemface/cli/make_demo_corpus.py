"""Builds a small, real demo corpus from the gettext catalogs installed on this system.

Example::

    python tools/make_demo_corpus.py --langs de,fr --out demo/corpus
    python tools/make_demo_corpus.py --langs de --doc-root /usr/share --out demo/corpus

writes mono/<lang>.txt, parallel/en-<xx>/{train,valid,test}.{en,<xx>}, dict/en-<xx>.tsv
and, last, report.json under the output directory (see megasemface.data.demo.demo_corpus).
Catalogs of names and translations that copy their source are left out. With --doc-root,
the Debian documentation installed there adds text, and the Debian Administrator's
Handbook's held-out chapters give valid and test (the catalogs' own: {valid,test}-catalogs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from megasemface.cli.parsing import command_parser, parse_or_status
from megasemface.data.demo import demo_corpus as dc
from megasemface.data.demo.message_cleaning import DEFAULT_MAX_CHARS

_PROG = "make_demo_corpus"


def _langs(text: str) -> list[str]:
    return [lang.strip() for lang in text.split(",") if lang.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults come from the demo corpus and message cleaning modules."""
    parser = command_parser(__doc__, prog=_PROG)
    parser.add_argument(
        "--langs",
        type=_langs,
        default=["de"],
        help="comma-separated target languages; the source is always en (default: de)",
    )
    parser.add_argument(
        "--locale-dir",
        type=Path,
        default=dc.DEFAULT_LOCALE_DIR,
        help="holds <lang>/LC_MESSAGES/*.mo (default: %(default)s)",
    )
    parser.add_argument(
        "--doc-root",
        type=Path,
        default=None,
        help="where Debian's documentation packages are installed (e.g. /usr/share: the "
        "handbook, the Debian Reference, man pages); default: the catalogs alone",
    )
    parser.add_argument(
        "--max-mono-lines",
        type=int,
        default=dc.DEFAULT_MAX_MONO_LINES,
        help="monolingual lines kept per language at most (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo/corpus"),
        help="output directory (default: %(default)s)",
    )
    parser.add_argument(
        "--max-chars",
        type=int,
        default=DEFAULT_MAX_CHARS,
        help="drop longer messages (default: %(default)s)",
    )
    parser.add_argument(
        "--test-fraction",
        type=float,
        default=dc.DEFAULT_TEST_FRACTION,
        help="share of pairs held out for test, by catalog (default: %(default)s)",
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=dc.DEFAULT_VALID_FRACTION,
        help="share of pairs held out for valid, by catalog (default: %(default)s)",
    )
    parser.add_argument(
        "--min-test-pairs",
        type=int,
        default=dc.DEFAULT_MIN_TEST_PAIRS,
        help="least test pairs per language pair, if that leaves half of its pairs "
        "(default: %(default)s)",
    )
    return parser


def _print_summary(report: dict[str, Any], out: Path, seconds: float) -> None:
    print(f"{'pair':<8}{'catalogs':>9}{'train':>9}{'valid':>8}{'test':>8}{'dict':>7}")
    for pair, info in report["pairs"].items():
        lang = pair.split("-", 1)[1]
        sizes = info["split_sizes"]
        print(
            f"{pair:<8}{report['languages'][lang]['catalogs_read']:>9}{sizes['train']:>9,}"
            f"{sizes['valid']:>8,}{sizes['test']:>8,}{info['dictionary']['entries']:>7,}"
        )
        if broken := report["languages"][lang]["catalogs_broken"]:
            print(f"{'':<8}{broken} broken catalog(s) skipped; see report.json")
        if names := len(report["languages"][lang]["name_catalogs"]):
            print(f"{'':<8}{names} catalog(s) of names left out (ISO codes, time zones, ...)")
    mono = ", ".join(f"{lang} {info['lines']:,}" for lang, info in report["mono"].items())
    print(f"mono lines: {mono}")
    print(f"wrote {out}/{{mono,parallel,dict}} and {out / 'report.json'} in {seconds:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input or no catalogs)."""
    parser = build_parser()
    args = parse_or_status(parser, argv)
    if isinstance(args, int):
        return args
    start = time.perf_counter()
    try:
        report = dc.build_demo_corpus(
            args.locale_dir,
            args.langs,
            args.out,
            max_chars=args.max_chars,
            test_fraction=args.test_fraction,
            valid_fraction=args.valid_fraction,
            min_test_pairs=args.min_test_pairs,
            doc_root=args.doc_root,
            max_mono_lines=args.max_mono_lines,
        )
    except (dc.DemoCorpusError, ValueError) as exc:  # no catalogs, or invalid options
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. an output directory that cannot be written
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    _print_summary(report, args.out, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
