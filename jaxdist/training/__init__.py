"""Training: the mesh-aware train step and what it composes (BatchNorm over replica groups,
loss scaling, large-batch optimizers, batch-size schedules), and the trainer that runs a
recipe with checkpoints."""

__all__: list[str] = []
