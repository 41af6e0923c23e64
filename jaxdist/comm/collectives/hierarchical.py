"""``hierarchical``: a two-level allreduce on axes ``(host, local)`` with any one-dimensional
schedule across hosts.

    1. reduce-scatter inside each host over the fast links      (axis local, L devices)
    2. allreduce across hosts over the slow links, each device carrying only 1/L of the data
       (inter_algorithm: any one-dimensional schedule)
    3. all-gather inside each host

With ``inter_algorithm="ring"`` this is the 2-D torus schedule
(:mod:`~jaxdist.comm.collectives.torus2d`, its inner-pair form included); the point of the
name is the link classes: the cost model prices steps 1 and 3 on intra-host links and step 2
on inter-host links. On two hosts, where the outer schedule is one pairwise swap,
``crossed_exchange=True`` runs step 2 as the crossed exchange
(:mod:`~jaxdist.comm.collectives.crossed_exchange`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.crossed_exchange import crossed_pair_sum, uses_crossed_exchange
from jaxdist.comm.collectives.one_dimensional import ONE_DIMENSIONAL
from jaxdist.comm.collectives.ring import RING
from jaxdist.comm.collectives.torus2d import (
    three_phase_allreduce,
    torus2d_allreduce,
    torus2d_terms,
    two_level_terms,
)
from jaxdist.comm.collectives.wire import Run, axis_size

__all__ = ["HIERARCHICAL", "hierarchical_allreduce"]


def hierarchical_allreduce(
    flat: jax.Array,
    axis_name: tuple[str, str],
    run: Run,
    *,
    inter_algorithm: str = "ring",
    crossed_exchange: bool = False,
) -> jax.Array:
    """Reduce-scatter inside each host, ``inter_algorithm`` across hosts on each device's
    share, all-gather inside each host."""
    across = _outer_algorithm(inter_algorithm)
    if across is RING:
        return torus2d_allreduce(flat, axis_name, run, crossed_exchange=crossed_exchange)
    host, local = axis_name
    if uses_crossed_exchange(
        axis_size(host), axis_size(local), across.swaps_on_two, crossed_exchange
    ):
        return three_phase_allreduce(
            flat, axis_name, run, lambda shard: crossed_pair_sum(shard, axis_name, run.wire)
        )
    outer_run = run._replace(divisor=None)
    return three_phase_allreduce(
        flat, axis_name, run, lambda shard: across.schedule(shard, host, outer_run)
    )


def _outer_algorithm(name: str) -> Algorithm:
    """The one-dimensional algorithm ``name``, or a ValueError naming those there are."""
    one_dimensional = tuple(ONE_DIMENSIONAL)
    if name not in one_dimensional:
        raise ValueError(
            f"hierarchical: inter_algorithm must be a one-dimensional schedule "
            f"{one_dimensional}, got {name!r}"
        )
    return ONE_DIMENSIONAL[name]


def _check_outer(axis_sizes: tuple[int, ...], options: Mapping[str, Any]) -> str | None:
    """The outer schedule must be one-dimensional and able to run across the outer axis."""
    name, one_dimensional = options["inter_algorithm"], tuple(ONE_DIMENSIONAL)
    if name not in one_dimensional:
        return f"inter_algorithm must be one of {one_dimensional}, got {name!r}"
    outer = axis_sizes[0]
    if ONE_DIMENSIONAL[name].power_of_two and outer & (outer - 1):
        return f"{name} across the outer axis needs a power of two, got {outer}"
    return None


def hierarchical_terms(
    axis_sizes: tuple[int, int], *, inter_algorithm: str, crossed_exchange: bool
) -> list[Term]:
    """The torus's terms, with ``inter_algorithm``'s cost across the outer axis."""
    across = _outer_algorithm(inter_algorithm)
    if across is RING:
        return torus2d_terms(axis_sizes, crossed_exchange=crossed_exchange)
    outer, inner = axis_sizes
    return two_level_terms(
        outer,
        inner,
        across.cost(outer, "inter"),
        crossed=uses_crossed_exchange(outer, inner, across.swaps_on_two, crossed_exchange),
        pair=False,
    )


HIERARCHICAL = Algorithm(
    name="hierarchical",
    summary="reduce-scatter inside hosts, any one-dimensional schedule across, all-gather",
    schedule=hierarchical_allreduce,
    cost=hierarchical_terms,
    levels=2,
    options={"inter_algorithm": "ring", "crossed_exchange": False},
    check_options=_check_outer,
)
