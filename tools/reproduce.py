#!/usr/bin/env python3
"""The paper's comparison of systems in one command (see megasemface.cli.reproduce)."""

from megasemface.cli.reproduce import main

if __name__ == "__main__":
    raise SystemExit(main())
