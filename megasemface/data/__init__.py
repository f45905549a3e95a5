"""Data path: raw text -> SentencePiece -> webdataset shards -> token-budget batches."""
