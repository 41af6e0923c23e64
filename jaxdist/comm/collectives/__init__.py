"""The allreduce family, written as collective-permute schedules.

Every schedule is made of ``jax.lax.ppermute`` steps and runs *inside* ``jax.shard_map``
(research code calls :func:`allreduce` from its own shard_map body). Each one lives in a
module of its own that reads as its algorithm, with its diagram, its alpha-beta cost terms
and its :class:`Algorithm` record:

=====================  ====================================================================
module                 schedule
=====================  ====================================================================
``native``             ``lax.psum``: XLA's own all-reduce, the reference
``ring``               reduce-scatter then all-gather round one ring
``bidirectional_ring`` two rings at once, one each way round
``torus2d``            2-D torus (Mikami et al.); its inner-pair form
``torus3d``            3-D torus: the 2-D torus between reduce-scatter and all-gather
``hierarchical``       two levels with any one-dimensional schedule across hosts
``crossed_exchange``   the two-host outer step with no pair sending both ways
``halving_doubling``   recursive halving and doubling (Rabenseifner)
``parameter_server``   one server gathers, sums and broadcasts
=====================  ====================================================================

Beside them: ``wire`` (how messages travel: pieces, transfer dtype), ``windows`` (cutting a
buffer of any size into equal windows without padding), ``ring_steps`` (the ring
reduce-scatter and all-gather every ring schedule is built from), ``algorithm`` (the
record), ``sharded`` (every schedule's two halves, reduce-scatter and all-gather, as
collectives of their own), ``one_dimensional`` (the one-axis schedules by name, which ``hierarchical`` runs
across hosts) and ``registry`` (the one place names are looked up, and :func:`allreduce`).

Axis names: the one-dimensional schedules take one mesh axis or a tuple of axes, which then
act as one flattened axis. The two-level schedules (``torus2d``, ``hierarchical``) take a
tuple ``(outer, inner)`` ordered like the mesh: the *inner* axis carries the full-size
reduce-scatter and all-gather, so it should be the one with the fast links. ``torus3d``
takes ``(outer, middle, inner)`` alike.

Any shape and size works: buffers are flattened and cut into windows; pytrees are fused into
one contiguous buffer per dtype (a gradient bucket) so that one schedule runs per dtype, not
one per leaf.

Type note for ``check_vma=True`` shard_maps: a ppermute result is typed as *varying* along the
axis even when every device ends up with the same values, and JAX has no cast from varying
back to invariant. Return the result with an ``out_spec`` that names the axis, or build the
shard_map with ``check_vma=False`` when the result should be declared replicated (``P()``).
"""

from jaxdist.comm.collectives.algorithm import COMMON_OPTIONS, Algorithm, Term, flat_link_class
from jaxdist.comm.collectives.registry import (
    ALGORITHMS,
    THREE_LEVEL,
    TWO_LEVEL,
    allreduce,
    check_names,
    common_options,
    get,
    one_dimensional,
    pack,
)
from jaxdist.comm.collectives.sharded import (
    GATHER_ALIGNMENT,
    SHARDED_ALGORITHMS,
    all_gather,
    all_gather_rows,
    reduce_scatter,
    sharded_terms,
    sharded_unsupported,
)
from jaxdist.comm.collectives.wire import (
    UNROLL_LIMIT,
    AxisName,
    axis_size,
    default_exchange_piece_bytes,
    permute,
)

__all__ = [
    "ALGORITHMS",
    "COMMON_OPTIONS",
    "GATHER_ALIGNMENT",
    "SHARDED_ALGORITHMS",
    "THREE_LEVEL",
    "TWO_LEVEL",
    "UNROLL_LIMIT",
    "Algorithm",
    "AxisName",
    "Term",
    "all_gather",
    "all_gather_rows",
    "allreduce",
    "axis_size",
    "check_names",
    "common_options",
    "default_exchange_piece_bytes",
    "flat_link_class",
    "get",
    "one_dimensional",
    "pack",
    "permute",
    "reduce_scatter",
    "sharded_terms",
    "sharded_unsupported",
]
