#!/usr/bin/env python3
"""Diagnoses a SemFace interface (see megasemface.cli.diagnose_interface)."""

from megasemface.cli.diagnose_interface import main

if __name__ == "__main__":
    raise SystemExit(main())
