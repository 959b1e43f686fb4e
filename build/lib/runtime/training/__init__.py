"""The Trainer and its loop: the step, its schedule, validation, checkpoints, guards and state."""
