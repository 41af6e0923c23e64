"""Alpha-beta cost model of every allreduce schedule in :mod:`jaxdist.comm.collectives`.

A message of ``S`` bytes over a link costs ``alpha + S * beta`` (latency plus bytes over
bandwidth). Each schedule is described by its *terms*: for every class of link it uses
(``"intra"``: inside a host / the inner mesh axis, ``"inter"``: between hosts / the outer axis),
how many sequential message steps it takes, how many times ``S`` bytes each device sends over
that class in all, and how many messages of a step could travel at once (its *lanes*: two for
the bidirectional ring, one for the rest). A link class has ``ports``: how many messages a
device can send at full rate at the same time over it. With ``c = min(lanes, ports)``
concurrent messages, time is then::

    sum over terms of  steps * ceil(lanes / ports) * alpha[class] + volume * S * beta[class] / c

The formulas (p devices, X inner x Y outer for the two-level schedules):

=====================  ==========================  ======================================
schedule               steps (alpha)               volume (x S beta)
=====================  ==========================  ======================================
ring                   2(p-1)                      2(p-1)/p
bidirectional_ring     2(p-1), two lanes           2(p-1)/p over both lanes; with ports
                                                   >= 2 the lanes run at once: (p-1)/p
halving_doubling       2 log2 p                    2(p-1)/p
parameter_server       2(p-1)                      2(p-1)     (the server's link)
torus2d / hierarchical intra 2(X-1), inter 2(Y-1)  intra 2(X-1)/X, inter 2(Y-1)/(XY)
... crossed, Y = 2     intra 2X-1, inter 1         intra (2X-1)/X, inter 1/X
... X = 2, ring        intra 1 + Y, inter 2(Y-1)   intra 1, inter (Y-1)/Y
torus3d (Z x Y x X)    intra 2(X-1) + torus2d's    intra 2(X-1)/X, then torus2d's on S/X
                       Y x Z steps (Z inter)
native (psum)          modelled as ring: XLA/NCCL use rings for large messages
=====================  ==========================  ======================================

Ports decide what the bidirectional ring gains. With one port (one NIC per host, or devices
that share one memory bus, as forced CPU devices do) its two rings take turns on the link: it
costs a ring's bandwidth term and twice its message count. With two (a separate link to each
ring neighbour: a TPU torus's ICI links, rings of point-to-point NVLink) both directions run
at full rate at once and the bandwidth term halves.

The crossed exchange (:mod:`~jaxdist.comm.collectives.crossed_exchange`,
``crossed_exchange=True`` on two hosts) runs the step between the hosts once instead of twice
and adds one hop inside host 0. On an inner axis of two with a ring across the outer axis, the
pair's all-gather goes as one exchange per block of the outer ring's all-gather
(:func:`~jaxdist.comm.collectives.torus2d.torus_pair_allreduce`): Y exchanges instead of one,
the same bytes.

Each schedule's terms are written beside it, in its module's ``*_terms`` function and its
:class:`~jaxdist.comm.collectives.Algorithm` record; this module prices them.

For ``torus2d`` the sum over both classes is 2(X+Y-2) alpha + 2(XY-1)/(XY) S beta (3Y-1
alpha when X = 2), the same bandwidth term as a flat ring with far fewer latency steps. A
one-dimensional schedule that spans a two-axis mesh runs every step over the slowest link it
crosses, so it is priced on ``"inter"`` (on ``"intra"`` when the outer axis has one device).

:func:`fit` recovers ``alpha`` and ``beta`` from measured times by least squares;
:func:`predict_all` prices every schedule on a mesh of any size (a planning preset included)
and :func:`parse_link` reads a link written as ``"5us:12.5GB/s"``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.comm import collectives
from jaxdist.comm.collectives import ALGORITHMS, Term

__all__ = [
    "Link",
    "Network",
    "bus_bandwidth",
    "fit",
    "parse_link",
    "predict",
    "predict_all",
]


@dataclass(frozen=True)
class Link:
    """One class of link: ``alpha`` seconds per message, ``beta`` seconds per byte, and
    ``ports``, the number of messages a device can send at full rate at the same time (1: one
    NIC or one memory bus for every destination; 2: a separate link to each ring neighbour)."""

    alpha: float
    beta: float
    ports: int = 1

    def __post_init__(self):
        try:
            ports = operator.index(self.ports)  # an int or a numpy integer, not 1.0
        except TypeError:
            ports = None
        if isinstance(self.ports, bool) or ports is None or ports < 1:
            raise ValueError(f"a link needs ports >= 1 (an integer), got {self.ports!r}")
        object.__setattr__(self, "ports", ports)

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


_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ns": 1e-9}
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)"
_RATE_UNITS = "bytes, B/s KB/s MB/s GB/s TB/s, or bits, b/s Mb/s Gb/s or bit, Mbit, Gbit"
_LINK_FORMAT = (
    "a link is LATENCY:BANDWIDTH, e.g. '5us:12.5GB/s' or '100us:1gbit' (latency in s, ms, us "
    f"or ns; bandwidth in {_RATE_UNITS} with or without /s)"
)


def _quantity(text: str) -> tuple[float, str] | None:
    """``"12.5 GB/s"`` -> ``(12.5, "GB/s")``; None unless ``text`` is a number and a unit."""
    match = re.fullmatch(_NUMBER + r"\s*(\S+)", text.strip(), re.IGNORECASE)
    return (float(match.group(1)), match.group(2)) if match else None


def _bytes_per_second(value: float, unit: str) -> float | None:
    """``value`` in ``unit`` as bytes per second, or None for an unknown unit. ``B`` is bytes
    and ``b`` bits, whatever the case of the prefix; ``bit`` is bits in any case."""
    match = re.fullmatch(r"([kmgtKMGT]?)(?:(B)(?i:/s)|b(?i:/s)|(?i:bit(?:/s)?))", unit)
    if not match:
        return None
    per_byte = 1.0 if match.group(2) == "B" else 1 / 8
    return value * _PREFIXES[match.group(1).lower()] * per_byte


def parse_rate(text: str) -> float:
    """Bytes per second of a rate such as ``"12.5GB/s"``, ``"1gbit"`` or ``"400 Mb/s"`` (units as
    in :func:`parse_link`)."""
    quantity = _quantity(text)
    rate = _bytes_per_second(*quantity) if quantity else None
    if rate is None:
        raise ValueError(
            f"a rate is a number and a unit, e.g. 1gbit or 12.5GB/s (in "
            f"{_RATE_UNITS}), got {text!r}"
        )
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"a rate must be finite and positive, got {text!r}")
    return rate


def parse_link(text: str, ports: int = 1) -> Link:
    """A link written as ``LATENCY:BANDWIDTH``, e.g. ``"5us:12.5GB/s"`` or ``"100us:1gbit"``.

    Latency in ``s``, ``ms``, ``us`` (or ``µs``) or ``ns``; bandwidth per direction of one link,
    decimal as network rates are, in bytes (``B/s``, ``KB/s``, ``MB/s``, ``GB/s``, ``TB/s``) or
    bits (``b/s``, ``Mb/s``, ``Gb/s``; ``bit``, ``Mbit``, ``Gbit``, with or without ``/s``, as
    ``tc`` writes them).
    """
    latency, sep, rate = text.partition(":")
    alpha, bandwidth = _quantity(latency), _quantity(rate)
    if not (sep and alpha and bandwidth) or alpha[1].lower() not in _SECONDS:
        raise ValueError(f"{_LINK_FORMAT}; got {text!r}")
    seconds = alpha[0] * _SECONDS[alpha[1].lower()]
    bytes_per_second = _bytes_per_second(*bandwidth)
    if bytes_per_second is None:
        raise ValueError(f"{_LINK_FORMAT}; got {text!r}")
    if not (math.isfinite(seconds) and math.isfinite(bytes_per_second) and bytes_per_second > 0):
        raise ValueError(
            f"a link needs a finite latency and a finite, positive bandwidth, got {text!r}"
        )
    return Link(seconds, 1 / bytes_per_second, ports)


def unsupported(
    algorithm: str, axis_sizes: Sequence[int], *, inter_algorithm: str = "ring"
) -> str | None:
    """Why ``algorithm`` cannot run on a mesh with ``axis_sizes`` (``hierarchical``: with
    ``inter_algorithm`` across the outer axis), or None."""
    try:
        chosen = collectives.get(algorithm)
    except ValueError as err:
        return str(err)
    return chosen.unsupported(axis_sizes, **_own_options(chosen, inter_algorithm=inter_algorithm))


def _own_options(chosen: collectives.Algorithm, **options) -> dict:
    """The options among ``options`` that ``chosen`` takes (None: its default)."""
    return {k: v for k, v in options.items() if k in chosen.options and v is not None}


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
    chosen = collectives.get(algorithm)
    options = _own_options(
        chosen, inter_algorithm=inter_algorithm, crossed_exchange=crossed_exchange
    )
    return chosen.terms(axis_sizes, **options)


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
    return price(
        terms(
            algorithm,
            axis_sizes,
            inter_algorithm=inter_algorithm,
            crossed_exchange=crossed_exchange,
        ),
        nbytes,
        network,
    )


def price(cost_terms: Sequence[Term], nbytes: float, network: Network | Link) -> float:
    """Seconds of ``cost_terms`` (a schedule's, or any collective's) for ``nbytes`` per
    device on ``network``."""
    if isinstance(network, Link):
        network = Network(network)
    seconds = 0.0
    for t in cost_terms:
        link = network.link(t.link_class)
        messages, volume = t.cost_factors(link.ports)
        seconds += messages * link.alpha + volume * nbytes * link.beta
    return seconds


def predict_all(
    nbytes: float,
    axis_sizes: Sequence[int],
    network: Network | Link,
    algorithms: Sequence[str] = ALGORITHMS,
    *,
    inter_algorithm: str = "ring",
    crossed_exchange: bool | None = None,
) -> dict[str, float | str]:
    """Each of ``algorithms``: its predicted seconds for ``nbytes`` per device, or the reason
    it cannot run on ``axis_sizes`` (see :func:`unsupported`)."""
    out: dict[str, float | str] = {}
    for algorithm in algorithms:
        reason = unsupported(algorithm, axis_sizes, inter_algorithm=inter_algorithm)
        out[algorithm] = reason or predict(
            algorithm,
            nbytes,
            axis_sizes,
            network,
            inter_algorithm=inter_algorithm,
            crossed_exchange=crossed_exchange,
        )
    return out


def fit(
    algorithm: str,
    axis_sizes: Sequence[int],
    nbytes: Sequence[float],
    seconds: Sequence[float],
    *,
    inter_algorithm: str = "ring",
    ports: int = 1,
) -> Link:
    """Least-squares ``alpha, beta >= 0`` of one link class from measured times of one schedule.

    Use it on a point-to-point measurement (``algorithm="p2p"``: time = alpha + S beta) or on
    any schedule whose terms all use the same class of link; ``ports`` is the link's (it
    decides how the bidirectional ring's two lanes are priced) and is kept in the result.
    """
    Link(0.0, 0.0, ports)  # refuses a bad port count before any fitting
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
        factors = [t.cost_factors(ports) for t in ts]
        steps = sum(messages for messages, _ in factors)
        volume = sum(v for _, v in factors)
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
    return Link(alpha=float(alpha), beta=float(beta), ports=ports)


def bus_bandwidth(nbytes: float, seconds: float, num_devices: int) -> tuple[float, float]:
    """nccl-tests bandwidths of an allreduce: ``(algbw, busbw)`` in bytes per second.

    algbw = S / t; busbw = algbw * 2(p-1)/p, comparable to a link's bandwidth whatever p is.
    """
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (num_devices - 1) / num_devices
