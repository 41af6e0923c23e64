"""Alpha-beta cost model of every allreduce schedule in :mod:`jaxdist.collectives`.

A message of ``S`` bytes over a link costs ``alpha + S * beta`` (latency plus bytes over
bandwidth). Each schedule is described by its *terms*: for every class of link it uses
(``"intra"``: inside a host / the inner mesh axis, ``"inter"``: between hosts / the outer axis),
how many sequential message steps it takes and how many times ``S`` bytes each device sends
over that class in sequence. Time is then::

    sum over link classes of  steps * alpha[class] + volume * S * beta[class]

The formulas (p devices, X inner x Y outer for the two-level schedules):

=====================  ==========================  ======================================
schedule               steps (alpha)               volume (x S beta)
=====================  ==========================  ======================================
ring                   2(p-1)                      2(p-1)/p
bidirectional_ring     2(p-1)                      (p-1)/p    (half the data each way,
                                                              full-duplex links)
halving_doubling       2 log2 p                    2(p-1)/p
parameter_server       2(p-1)                      2(p-1)     (the server's link)
torus2d / hierarchical intra 2(X-1), inter 2(Y-1)  intra 2(X-1)/X, inter 2(Y-1)/(XY)
... crossed, Y = 2     intra 2X-1, inter 1         intra (2X-1)/X, inter 1/X
native (psum)          modelled as ring: XLA/NCCL use rings for large messages
=====================  ==========================  ======================================

The crossed exchange (``collectives._crossed_pair_sum``, ``crossed_exchange=True`` on two hosts)
runs the step between the hosts once instead of twice and adds one hop inside host 0.

For ``torus2d`` the sum over both classes is 2(X+Y-2) alpha + 2(XY-1)/(XY) S beta, the same
bandwidth term as a flat ring with far fewer latency steps. A one-dimensional schedule that
spans a two-axis mesh runs every step over the slowest link it crosses, so it is priced on
``"inter"``.

:func:`fit` recovers ``alpha`` and ``beta`` from measured times by least squares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.collectives import ALGORITHMS, option_default, uses_crossed_exchange


@dataclass(frozen=True)
class Link:
    """One class of link: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``inf`` when beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


@dataclass(frozen=True)
class Network:
    """The links a mesh has: ``intra`` (inner axis / inside a host) and ``inter`` (outer axis /
    between hosts). With ``inter=None`` both classes are the same link."""

    intra: Link
    inter: Link | None = None

    def link(self, link_class: str) -> Link:
        if link_class == "intra" or self.inter is None:
            return self.intra
        return self.inter


@dataclass(frozen=True)
class Term:
    """``steps`` sequential messages and ``volume * S`` bytes sent over ``link_class``."""

    link_class: str
    steps: float
    volume: float


def _one_dimensional_terms(algorithm: str, p: int, link_class: str) -> list[Term]:
    if p == 1:
        return []
    if algorithm in ("ring", "native"):
        return [Term(link_class, 2 * (p - 1), 2 * (p - 1) / p)]
    if algorithm == "bidirectional_ring":
        if p <= 2:
            return [Term(link_class, 2 * (p - 1), 2 * (p - 1) / p)]
        return [Term(link_class, 2 * (p - 1), (p - 1) / p)]
    if algorithm == "halving_doubling":
        if p & (p - 1):
            raise ValueError(f"halving_doubling needs a power-of-two device count, got {p}")
        return [Term(link_class, 2 * math.log2(p), 2 * (p - 1) / p)]
    if algorithm == "parameter_server":
        return [Term(link_class, 2 * (p - 1), 2 * (p - 1))]
    raise ValueError(f"{algorithm!r} is not a one-dimensional schedule")


def terms(
    algorithm: str,
    axis_sizes: Sequence[int],
    *,
    inter_algorithm: str = "ring",
    crossed_exchange: bool | None = None,
) -> list[Term]:
    """The cost terms of ``algorithm`` on a mesh with ``axis_sizes`` (outer to inner);
    ``inter_algorithm`` and ``crossed_exchange`` as for the two-level schedules (``None``:
    the schedule's own default)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    sizes = tuple(int(s) for s in axis_sizes)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"axis sizes must be positive integers, got {axis_sizes!r}")
    if algorithm in ("torus2d", "hierarchical"):
        if len(sizes) != 2:
            raise ValueError(f"{algorithm} needs two axes (outer, inner), got sizes {sizes}")
        outer, inner = sizes
        intra = [Term("intra", 2 * (inner - 1), 2 * (inner - 1) / inner)] if inner > 1 else []
        inter_alg = "ring" if algorithm == "torus2d" else inter_algorithm
        if crossed_exchange is None:
            crossed_exchange = option_default(algorithm, "crossed_exchange")
        if uses_crossed_exchange(outer, inner, inter_alg, crossed_exchange):
            return [*intra, Term("intra", 1, 1 / inner), Term("inter", 1, 1 / inner)]
        # The outer allreduce moves only 1/inner of the data.
        inter = [
            Term(t.link_class, t.steps, t.volume / inner)
            for t in _one_dimensional_terms(inter_alg, outer, "inter")
        ]
        return intra + inter
    link_class = "inter" if len([s for s in sizes if s > 1]) > 1 else "intra"
    return _one_dimensional_terms(algorithm, math.prod(sizes), link_class)


def predict(
    algorithm: str,
    nbytes: float,
    axis_sizes: Sequence[int],
    network: Network | Link,
    *,
    inter_algorithm: str = "ring",
    crossed_exchange: bool | None = None,
) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` bytes per device."""
    if isinstance(network, Link):
        network = Network(network)
    return sum(
        t.steps * network.link(t.link_class).alpha
        + t.volume * nbytes * network.link(t.link_class).beta
        for t in terms(
            algorithm,
            axis_sizes,
            inter_algorithm=inter_algorithm,
            crossed_exchange=crossed_exchange,
        )
    )


def fit(
    algorithm: str,
    axis_sizes: Sequence[int],
    nbytes: Sequence[float],
    seconds: Sequence[float],
    *,
    inter_algorithm: str = "ring",
) -> Link:
    """Least-squares ``alpha, beta >= 0`` of one link class from measured times of one schedule.

    Use it on a point-to-point measurement (``algorithm="p2p"``: time = alpha + S beta) or on
    any schedule whose terms all use the same class of link.
    """
    nbytes = np.asarray(nbytes, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    if nbytes.shape != seconds.shape or nbytes.size < 2:
        raise ValueError(
            f"fit needs at least two (bytes, seconds) pairs of equal length, got "
            f"{nbytes.size} sizes and {seconds.size} times"
        )
    if algorithm == "p2p":
        steps, volume = 1.0, 1.0
    else:
        ts = terms(algorithm, axis_sizes, inter_algorithm=inter_algorithm)
        if len({t.link_class for t in ts}) > 1:
            raise ValueError(
                f"{algorithm} on {tuple(axis_sizes)} uses two link classes; fit each separately"
            )
        steps = sum(t.steps for t in ts)
        volume = sum(t.volume for t in ts)
    design = np.stack([np.full_like(nbytes, steps), volume * nbytes], axis=1)
    # Relative least squares: small messages would otherwise carry no weight at all.
    weights = 1.0 / seconds
    (alpha, beta), *_ = np.linalg.lstsq(design * weights[:, None], seconds * weights, rcond=None)
    if alpha < 0:  # refit with alpha pinned at 0
        alpha = 0.0
        beta = float(
            np.sum(weights**2 * design[:, 1] * seconds) / np.sum((weights * design[:, 1]) ** 2)
        )
    if beta < 0:
        beta = 0.0
        alpha = float(
            np.sum(weights**2 * design[:, 0] * seconds) / np.sum((weights * design[:, 0]) ** 2)
        )
    return Link(alpha=float(alpha), beta=float(beta))


def bus_bandwidth(nbytes: float, seconds: float, num_devices: int) -> tuple[float, float]:
    """nccl-tests bandwidths of an allreduce: ``(algbw, busbw)`` in bytes per second.

    algbw = S / t; busbw = algbw * 2(p-1)/p, comparable to a link's bandwidth whatever p is.
    """
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (num_devices - 1) / num_devices
