"""Training: a run's options and their checks before start-up, the one training loop
(``trainer.py``) and the stages' train units (``units/``), signals, schedules and step
accounting. The DeepSpeed engine facade is in ``distributed/``, the checkpoint layout and
tools in ``checkpoints/``."""
