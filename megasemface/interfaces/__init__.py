"""Semantic interfaces between the separately pre-trained encoder and decoder."""
