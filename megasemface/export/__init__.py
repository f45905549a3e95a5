"""Exports of translation model directories: Hugging Face transformers and CTranslate2."""
