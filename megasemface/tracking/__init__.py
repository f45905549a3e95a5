"""Experiment tracking (MLflow) for the trainer; see :mod:`megasemface.tracking.mlflow_tracker`."""
