#!/usr/bin/env python3
"""Compares runs tracked in MLflow: tables and plots (see megasemface.cli.compare_runs)."""

from megasemface.cli.compare_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
