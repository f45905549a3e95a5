#!/usr/bin/env python3
"""Builds webdataset token shards from monolingual text (see megasemface.cli.build_shards)."""

from megasemface.cli.build_shards import main

if __name__ == "__main__":
    raise SystemExit(main())
