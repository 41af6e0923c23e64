"""``parameter_server``: every worker sends its whole buffer to one server, which sums and
sends the sum back to each worker in turn::

    gather     1 --> 0, 2 --> 0, 3 --> 0     (one worker at a time)
    broadcast  0 --> 1, 0 --> 2, 0 --> 3

The server's link carries ``2 (p - 1)`` full buffers, so time grows linearly with ``p``: the
baseline the decentralised schedules are measured against.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.wire import AxisName, Run, as_sent, axis_size, divided, send

__all__ = ["PARAMETER_SERVER", "parameter_server_allreduce"]


def parameter_server_allreduce(
    flat: jax.Array, axis_name: AxisName, run: Run, *, server: int = 0
) -> jax.Array:
    """Gather every worker's buffer at ``server`` one worker at a time, sum, broadcast back one
    worker at a time. Always unrolled: each step is a different one-pair permutation (never
    an exchange, so never sent in pieces)."""
    p = axis_size(axis_name)
    if not 0 <= server < p:
        raise ValueError(f"parameter_server: server must be in [0, {p}), got {server}")
    i = lax.axis_index(axis_name)
    wire, divisor = run.wire, run.divisor
    workers = [w for w in range(p) if w != server]
    total = flat
    for w in workers:  # gather: a one-pair ppermute delivers zeros everywhere but the server
        total = total + send(flat, axis_name, [(w, server)], wire)
    total = as_sent(total, wire)
    result = jnp.where(i == server, divided(total, divisor), jnp.zeros_like(total))
    for w in workers:  # broadcast
        result = result + divided(send(total, axis_name, [(server, w)], wire), divisor)
    return result


def parameter_server_terms(p: int, link_class: str) -> list[Term]:
    """``2 (p - 1)`` steps; the server's link carries ``2 (p - 1)`` buffers."""
    return [Term(link_class, 2 * (p - 1), 2 * (p - 1))] if p > 1 else []


def _check_server(axis_sizes: tuple[int, ...], options: Mapping[str, Any]) -> str | None:
    p, server = math.prod(axis_sizes), options["server"]
    if isinstance(server, bool) or not isinstance(server, numbers.Integral) or not 0 <= server < p:
        return f"server must be in [0, {p}), got {server!r}"
    return None


PARAMETER_SERVER = Algorithm(
    name="parameter_server",
    summary="one server gathers, sums and broadcasts: linear in the device count",
    schedule=parameter_server_allreduce,
    cost=parameter_server_terms,
    options={"server": 0},
    check_options=_check_server,
)
