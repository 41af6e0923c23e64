"""The schedules that run on one axis (or a tuple of axes acting as one), by name.

Kept apart from the registry so that ``hierarchical``, which runs any of them across its outer
axis, can look them up without importing the registry that lists ``hierarchical`` itself.
"""

from __future__ import annotations

from jaxdist.comm.collectives.algorithm import Algorithm
from jaxdist.comm.collectives.bidirectional_ring import BIDIRECTIONAL_RING
from jaxdist.comm.collectives.halving_doubling import HALVING_DOUBLING
from jaxdist.comm.collectives.native import NATIVE
from jaxdist.comm.collectives.parameter_server import PARAMETER_SERVER
from jaxdist.comm.collectives.ring import RING

__all__: list[str] = []  # building blocks of the package's own modules

#: Name -> record of every one-dimensional schedule, in the order tables list them.
ONE_DIMENSIONAL: dict[str, Algorithm] = {
    a.name: a for a in (NATIVE, RING, BIDIRECTIONAL_RING, HALVING_DOUBLING, PARAMETER_SERVER)
}
