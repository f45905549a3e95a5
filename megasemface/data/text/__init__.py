"""Text: corpora read and written, cleaning, languages, the SentencePiece tokenizer and its
training, and random aligned substitution's dictionaries."""
