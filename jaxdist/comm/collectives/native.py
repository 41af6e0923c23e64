"""``native``: XLA's own all-reduce (``lax.psum``), the reference every schedule is checked
against. XLA and the runtime (NCCL, ICI, gloo) choose its algorithm and messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.algorithm import Algorithm
from jaxdist.comm.collectives.ring import ring_terms
from jaxdist.comm.collectives.wire import AxisName, Run, divided

__all__ = ["NATIVE", "native_allreduce"]


def native_allreduce(flat: jax.Array, axis_name: AxisName, run: Run) -> jax.Array:
    """``lax.psum`` of ``flat``; with a transfer dtype the psum itself runs in that dtype."""
    dtype = run.wire.dtype
    if dtype is None or jnp.dtype(dtype) == flat.dtype:
        return divided(lax.psum(flat, axis_name), run.divisor)
    summed = lax.psum(flat.astype(dtype), axis_name).astype(flat.dtype)
    return divided(summed, run.divisor)


NATIVE = Algorithm(
    name="native",
    summary="lax.psum: XLA's own all-reduce",
    schedule=native_allreduce,
    cost=ring_terms,  # priced as a ring: XLA and NCCL use rings for large messages
)
