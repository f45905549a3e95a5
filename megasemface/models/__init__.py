"""Trainable models: the SemFace pre-training model, the mBART-style baseline, the translation
model and VECO's, built from the building blocks in ``megasemface.nn`` and the interfaces."""
