#!/usr/bin/env python3
"""Trains a joint SentencePiece model over monolingual corpora (see megasemface.cli.train_spm)."""

from megasemface.cli.train_spm import main

if __name__ == "__main__":
    raise SystemExit(main())
