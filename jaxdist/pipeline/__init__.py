"""Pipeline parallelism: a model cut into stages over a mesh axis, micro-batches streamed
through them (:mod:`~jaxdist.pipeline.schedules`: GPipe, 1F1B and interleaved 1F1B as tables)."""

__all__: list[str] = []
