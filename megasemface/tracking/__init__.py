"""Experiment tracking (MLflow) for the trainer.

:mod:`megasemface.tracking.tracker` is what the trainer calls, and
:mod:`megasemface.tracking.mlflow_tracker` records it in MLflow.
"""
