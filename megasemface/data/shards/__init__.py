"""Token shards: their on-disk format and manifest, and building them from text."""
