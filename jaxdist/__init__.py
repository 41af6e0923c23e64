"""jaxdist: a JAX/XLA-native sharded training toolkit.

Modules, one concern each:

* :mod:`jaxdist.meshes` – mesh specs (data) and the builders that turn them into devices.
* :mod:`jaxdist.collectives` – the allreduce family written as ``ppermute`` schedules.
* :mod:`jaxdist.cost_model` – alpha-beta predictions for every schedule, and fitting.
* :mod:`jaxdist.bench` – the nccl-tests-style collective benchmark.

Submodules are imported lazily so that ``import jaxdist`` never initialises a JAX backend
before a caller had the chance to set ``XLA_FLAGS``.
"""

__version__ = "0.1.0"
