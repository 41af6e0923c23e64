"""Communication: the allreduce family (:mod:`~jaxdist.comm.collectives`), its cost model
(:mod:`~jaxdist.comm.cost_model`) and gradient buckets (:mod:`~jaxdist.comm.buckets`)."""

__all__: list[str] = []
