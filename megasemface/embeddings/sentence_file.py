"""One language's token-id sentences as a text file, one sentence a line, for word2vec-style
trainers that read files (gensim's ``corpus_file``, fastText's ``input``).

Their file readers are their fast paths: C threads that each read their own part of the
file, where feeding Python sentences holds the GIL for every token. Each id is written as its
decimal number, or as any word per id given (e.g. its SentencePiece piece). The text is built
with numpy, a block of sentences at a time, never with a Python object per token: 50M
sentences of 30 tokens are 1.5 billion tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["id_words", "write_sentence_file"]


def id_words(vocab_size: int) -> list[str]:
    """Each id's word in the file: its decimal number."""
    return [str(i) for i in range(vocab_size)]


def _word_table(words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """([V, longest] uint8 bytes of each word, zero-padded), and [V] byte lengths."""
    encoded = [w.encode("utf-8") for w in words]
    for word in encoded:
        if not word or any(c in word for c in b" \t\n\r\v\f"):
            raise ValueError(f"a word of the file is empty or holds white space: {word!r}")
    lengths = np.array([len(w) for w in encoded], dtype=np.int64)
    table = np.zeros((len(encoded), int(lengths.max())), dtype=np.uint8)
    for i, word in enumerate(encoded):
        table[i, : len(word)] = np.frombuffer(word, dtype=np.uint8)
    return table, lengths


def write_sentence_file(
    path: Path,
    tokens: np.ndarray,
    offsets: np.ndarray,
    words: Sequence[str],
    block_tokens: int = 1 << 22,
) -> int:
    """Writes sentences ``tokens[offsets[i]:offsets[i + 1]]`` as lines of space-separated
    ``words[id]``; returns the bytes written. Empty sentences are skipped (a blank line is a
    sentence of no words to every reader). Memory: about 50 bytes per token of a block
    (2^22 tokens: 200 MB)."""
    table, lengths = _word_table(words)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths_of_sentences = np.diff(offsets)
    offsets = offsets[np.concatenate([lengths_of_sentences > 0, [True]])]
    written = 0
    with open(path, "wb") as out:
        first = 0
        while first < len(offsets) - 1:
            # Whole sentences, about block_tokens tokens (at least one sentence).
            last = int(np.searchsorted(offsets, offsets[first] + block_tokens, side="right")) - 1
            last = min(max(last, first + 1), len(offsets) - 1)
            block = np.asarray(tokens[offsets[first] : offsets[last]], dtype=np.int64)
            ends = offsets[first + 1 : last + 1] - offsets[first] - 1  # last token of each line
            size = lengths[block] + 1  # the word and the space or newline after it
            starts = np.cumsum(size) - size
            text = np.empty(int(size.sum()), dtype=np.uint8)
            for j in range(table.shape[1]):
                has = lengths[block] > j
                text[starts[has] + j] = table[block[has], j]
            after = starts + size - 1
            text[after] = ord(" ")
            text[after[ends]] = ord("\n")
            out.write(text.tobytes())
            written += text.size
            first = last
    return written
