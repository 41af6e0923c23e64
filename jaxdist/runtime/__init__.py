"""Runtime: joining a multi-process run (:mod:`~jaxdist.runtime.distributed`), starting one
on the local machine (:mod:`~jaxdist.runtime.launch`) or on an emulated cluster
(:mod:`~jaxdist.runtime.cluster`), and bounding queued calls (:mod:`~jaxdist.runtime.dispatch`)."""

__all__: list[str] = []
