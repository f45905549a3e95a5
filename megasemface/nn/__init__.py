"""Transformer encoder and decoder, their configuration and presets."""
