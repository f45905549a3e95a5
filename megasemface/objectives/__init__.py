"""Pre-training objectives: noising functions, losses and the stage units that combine them."""
