#!/usr/bin/env python3
"""Translates sentences with a seq2seq model directory (see megasemface.cli.translate)."""

from megasemface.cli.translate import main

if __name__ == "__main__":
    raise SystemExit(main())
