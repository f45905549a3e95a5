#!/usr/bin/env python3
"""Builds the demo corpus from this system's gettext catalogs (see cli.make_demo_corpus)."""

from megasemface.cli.make_demo_corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
