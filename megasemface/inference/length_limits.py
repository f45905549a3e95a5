"""How long a generated sentence may be by default, fairseq's: at most a x its source's
length + b tokens. Torch-free, so that train.py's options read the same defaults as the
search."""

from __future__ import annotations

__all__ = ["MAX_LEN_A", "MAX_LEN_B"]

MAX_LEN_A = 1.2
MAX_LEN_B = 10
