"""Pipeline parallelism: a model cut into stages over a mesh axis, micro-batches streamed
through them by a schedule, each stage's gradients averaged over the other axes.

:mod:`~jaxdist.pipeline.schedules` (GPipe, 1F1B, interleaved 1F1B and PipeDream's
asynchronous schedules as tables), :mod:`~jaxdist.pipeline.asynchronous` (PipeDream's weight
stashing and 2BW's two versions),
:mod:`~jaxdist.pipeline.program` (a table as the integer tables a program steps through),
:mod:`~jaxdist.pipeline.stages` (a model as stages, and the flat buffers they share),
:mod:`~jaxdist.pipeline.state` (each stage's trees as flat rows of the step's state),
:mod:`~jaxdist.pipeline.passes` (one tick's forward or backward pass, the loop over ticks,
one stage's update), :mod:`~jaxdist.pipeline.options` (what a pipeline step refuses),
:mod:`~jaxdist.pipeline.step` (:class:`~jaxdist.pipeline.step.PipelineStep`, the train step),
and for cutting a model into stages of equal time :mod:`~jaxdist.pipeline.profile` (per-layer
costs) and :mod:`~jaxdist.pipeline.partition` (the cut that minimises the slowest stage).
A recipe's ``pipeline`` fields are built by :mod:`jaxdist.run.pipeline_config`.
"""

__all__: list[str] = []
