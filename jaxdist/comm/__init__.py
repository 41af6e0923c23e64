"""Communication: the allreduce family (:mod:`~jaxdist.comm.collectives`), its cost model
(:mod:`~jaxdist.comm.cost_model`), gradient buckets (:mod:`~jaxdist.comm.buckets`), dense
gradients from sufficient factors (:mod:`~jaxdist.comm.sufficient_factors`) and the cheapest
route for each gradient (:mod:`~jaxdist.comm.hybrid`)."""

__all__: list[str] = []
