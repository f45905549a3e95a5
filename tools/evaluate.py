#!/usr/bin/env python3
"""Scores translations against references with BLEU and chrF (see megasemface.cli.evaluate)."""

from megasemface.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
