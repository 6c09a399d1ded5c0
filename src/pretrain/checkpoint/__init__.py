"""Checkpoints: ``manager`` saves and loads sharded DCP checkpoints (any layout into any
other) and keeps the newest; ``resume`` decides, before the model exists, where a run
continues from and whether that checkpoint fits this run."""
