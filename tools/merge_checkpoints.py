#!/usr/bin/env python3
"""Consolidates, averages and connects checkpoints (see megasemface.cli.merge_checkpoints)."""

from megasemface.cli.merge_checkpoints import main

if __name__ == "__main__":
    raise SystemExit(main())
