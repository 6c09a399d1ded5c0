"""One module per optimizer: its builder, its state count and its ``register(OptimizerSpec
(...))`` (optim/registry.py). optim/specs.py imports every module here."""
