#!/usr/bin/env python3
"""Pre-training learning curves of systems side by side (see megasemface.cli.learning_curves)."""

from megasemface.cli.learning_curves import main

if __name__ == "__main__":
    raise SystemExit(main())
