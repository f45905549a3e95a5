#!/usr/bin/env python3
"""Builds the CL-SemFace cross-lingual embedding table (see megasemface.cli.build_cl_embeddings)."""

from megasemface.cli.build_cl_embeddings import main

if __name__ == "__main__":
    raise SystemExit(main())
