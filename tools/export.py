#!/usr/bin/env python3
"""Exports a model directory for transformers or CTranslate2 (see megasemface.cli.export)."""

from megasemface.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
