"""The whole SemFace pipeline as one command: data, pre-training, connecting, fine-tuning,
evaluation and the comparison of systems (the README's main command, tools/reproduce.py)."""
