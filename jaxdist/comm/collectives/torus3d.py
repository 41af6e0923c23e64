"""``torus3d``: the 3-D torus allreduce on axes ``(outer, middle, inner)``.

Devices in a Z x Y x X grid, as the chips of a TPU v4 or v5p slice are wired::

    1. reduce-scatter along the inner axis                  (in every row of X)
       every device holds 1/X of the data, summed over its row
    2. the 2-D torus allreduce of that 1/X over (outer, middle)   (in every Z x Y plane)
    3. all-gather along the inner axis                      (in every row of X)

``2 (X - 1) + 2 (Y - 1) + 2 (Z - 1)`` latency steps: on 1,024 chips laid 16 x 8 x 8, 58
dependent steps where a 32 x 32 torus takes 124, with the same bandwidth term. A bucket's
chain that short fits beside the backward pass of the layers before it, which is what lets a
wait-free step hide it (:mod:`jaxdist.training.wait_free`).
"""

from __future__ import annotations

import jax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.torus2d import (
    three_phase_allreduce,
    torus2d_allreduce,
    torus2d_terms,
    two_level_terms,
)
from jaxdist.comm.collectives.wire import Run

__all__ = ["TORUS3D", "torus3d_allreduce"]


def torus3d_allreduce(flat: jax.Array, axis_name: tuple[str, str, str], run: Run) -> jax.Array:
    """Reduce-scatter along the inner axis, the 2-D torus over (outer, middle) on each
    device's window, all-gather along the inner axis."""
    outer, middle, inner = axis_name
    across = run._replace(divisor=None)  # the mean is taken once, as the all-gather writes
    return three_phase_allreduce(
        flat, (middle, inner), run, lambda shard: torus2d_allreduce(shard, (outer, middle), across)
    )


def torus3d_terms(axis_sizes: tuple[int, int, int]) -> list[Term]:
    """Inner ``2 (X - 1)`` steps and ``2 (X - 1) / X`` of the data, then the 2-D torus's terms
    on ``1 / X`` of it (its middle axis on ``"intra"`` links, its outer on ``"inter"``)."""
    outer, middle, inner = axis_sizes
    plane = torus2d_terms((outer, middle), crossed_exchange=False)
    return two_level_terms(outer * middle, inner, plane, crossed=False, pair=False)


TORUS3D = Algorithm(
    name="torus3d",
    summary="3-D torus: reduce-scatter inner, 2-D torus over outer x middle, all-gather inner",
    schedule=torus3d_allreduce,
    cost=torus3d_terms,
    levels=3,
)
