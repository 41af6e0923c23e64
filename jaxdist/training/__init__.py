"""Training: the data-parallel train step and what both kinds of step are built from
(the :class:`~jaxdist.training.protocol.Step` interface, BatchNorm over replica groups, loss
scaling, large-batch optimizers, batch-size schedules). The trainer that runs a recipe is in
:mod:`jaxdist.run`."""

__all__: list[str] = []
