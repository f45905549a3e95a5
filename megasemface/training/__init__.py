"""Training: the DeepSpeed engine facade, checkpoints, signals and the training loop."""
