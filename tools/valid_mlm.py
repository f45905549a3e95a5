#!/usr/bin/env python3
"""The encoder MLM of a finished pre-training on validation text (see
megasemface.cli.valid_mlm)."""

from megasemface.cli.valid_mlm import main

if __name__ == "__main__":
    raise SystemExit(main())
