"""Hybrid communication: for each gradient, the cheapest way to average it, by the cost model.

Poseidon (Zhang et al., 2017) sends each layer's gradient either through a parameter server or
as *sufficient factors*: the weight gradient of a dense layer over ``b`` examples is
``X^T G`` with ``X`` (b x m) the layer's inputs and ``G`` (b x n) the loss gradient at its
outputs, so broadcasting ``b (m + n)`` numbers can replace ``m n``. Its rule prices both and
takes the cheaper one per layer.

Here the rule covers the whole allreduce family. For every gradient bucket the candidates are
every schedule the data axes can run (:func:`runnable_schedules`); for every dense layer that
may travel as factors, the candidates are the same schedules on its ``m x n`` kernel and a ring
all-gather of its factors over all ``R`` devices, which costs

    (R - 1) alpha + (R - 1) s beta,    s = rows (m + n) x bytes per number

(each device receives every other device's ``s`` bytes), against a ring allreduce's
``2 (R - 1) alpha + 2 (R - 1) / R x m n x bytes x beta``: without latency, factors win when
``R rows (m + n) < 2 m n``. Small per-device batches and wide layers favour factors; large
batches and narrow layers the dense gradient.

Factors also cost arithmetic: every device rebuilds the mean gradient as one product over all
``R rows`` rows, ``2 R rows m n`` flops, where its own backward would have formed
``2 rows m n`` for its local gradient. Poseidon leaves this out (a GPU does it in
microseconds); given a device's matrix-product rate (``Links.flops``) the extra
``2 (R - 1) rows m n / flops`` seconds are added to the factors' price.

The links come from ``jaxdist bench allreduce --json`` (fitted on the mesh the step runs on),
from ``LATENCY:BANDWIDTH`` text, or from the link ``jaxdist cluster`` emulates
(:func:`resolve_links`). ``native`` is not a candidate: the model prices it as a ring, so it
could never be told apart from one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxdist.comm import collectives, cost_model, emulated_link
from jaxdist.comm.collectives import Term, flat_link_class

__all__ = [
    "AUTO",
    "Links",
    "Route",
    "rank_schedules",
    "resolve_links",
]

AUTO = "auto"  # the train step's allreduce name for "choose per bucket"
FACTORS = "sfb"  # the route of a dense layer whose gradient travels as sufficient factors
DENSE = "dense"  # the route of a dense layer whose gradient joins the buckets


@dataclass(frozen=True)
class Links:
    """The links a step is priced on: ``flat`` prices the one-dimensional schedules and the
    factor all-gather (every step over the slowest link crossed), ``axes`` the schedules on
    several axes (``None``: ``flat`` for both classes). ``source`` says where they came from.
    ``flops``: a device's float32 matrix-product rate, to price rebuilding a gradient from its
    factors (``None``: communication only, as Poseidon's rule)."""

    flat: cost_model.Link
    axes: cost_model.Network | None = None
    source: str = ""
    flops: float | None = None

    def __post_init__(self):
        if self.flops is not None and not (math.isfinite(self.flops) and self.flops > 0):
            raise ValueError(f"flops must be a finite, positive rate, got {self.flops!r}")

    def for_schedule(self, algorithm: str) -> cost_model.Link | cost_model.Network:
        on_levels = collectives.get(algorithm).levels > 1
        return self.axes if on_levels and self.axes is not None else self.flat


_HOW_TO_GET_LINKS = (
    "give links='LATENCY:BANDWIDTH' (e.g. '50us:1gbit') or the JSON file of `jaxdist bench "
    "allreduce --json PATH` run on this mesh"
)


def resolve_links(spec, axis_sizes: Sequence[int]) -> Links:
    """The :class:`Links` for a mesh whose data axes have ``axis_sizes``, from ``spec``:

    * a :class:`~jaxdist.comm.cost_model.Link`, a :class:`~jaxdist.comm.cost_model.Network`
      (``intra`` inside a host, ``inter`` between hosts) or a :class:`Links`;
    * ``"LATENCY:BANDWIDTH"`` text (:func:`jaxdist.comm.cost_model.parse_link`);
    * the path of a ``jaxdist bench allreduce --json`` file, which must come from a mesh with
      the same axis sizes;
    * ``None``: the link ``jaxdist cluster`` emulates (its ``JAXDIST_LINK_LATENCY`` and
      ``JAXDIST_LINK_BITS_PER_S``); outside one there is nothing to go on, and it refuses.
    """
    sizes = tuple(int(s) for s in axis_sizes)
    if isinstance(spec, Links):
        return spec
    if isinstance(spec, cost_model.Link):
        return Links(spec, None, "given link")
    if isinstance(spec, cost_model.Network):
        return Links(spec.link("inter"), spec, "given network")
    if spec is None:
        return _links_from_environment()
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"links: expected a Link, a Network, 'LATENCY:BANDWIDTH' or a path, "
            f"got {type(spec).__name__}"
        )
    text = os.fspath(spec)
    if Path(text).is_file():
        return _links_from_file(Path(text), sizes)
    if text.endswith(".json"):
        raise FileNotFoundError(f"links file {text} does not exist; {_HOW_TO_GET_LINKS}")
    return Links(cost_model.parse_link(text), None, f"given {text}")


def _links_from_environment() -> Links:
    link = emulated_link.link_from_environment()
    if link is None:
        raise ValueError(
            f"allreduce='auto' needs link figures to price the schedules: {_HOW_TO_GET_LINKS}"
        )
    return Links(link, None, "the emulated cluster's link")


def _links_from_file(path: Path, sizes: tuple[int, ...]) -> Links:
    try:
        record = json.loads(path.read_text())
        measured = tuple(int(s) for s in record["axis_sizes"])
        flat = _link_of(record["link"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"links file {path} is not the JSON of `jaxdist bench allreduce "
            f"--json` ({type(err).__name__}: {err})"
        ) from None
    if measured != sizes:
        raise ValueError(
            f"links file {path} was measured on mesh {record.get('mesh', '?')} with axis sizes "
            f"{measured}; this step's data axes have sizes {sizes}: measure on this mesh"
        )
    axes = None
    if "intra_link" in record and "inter_link" in record:
        axes = cost_model.Network(_link_of(record["intra_link"]), _link_of(record["inter_link"]))
    return Links(flat, axes, str(path))


def _link_of(record: dict) -> cost_model.Link:
    return cost_model.Link(
        float(record["alpha_s"]), float(record["beta_s_per_byte"]), int(record["ports"])
    )


# --------------------------------------------------------------------------- pricing


def runnable_schedules(axis_sizes: Sequence[int]) -> list[str]:
    """The schedules of the family that can run over data axes of ``axis_sizes`` with their
    default options: two- and three-level ones need as many axes, halving-doubling a power of
    two."""
    names = [name for name in collectives.ALGORITHMS if name != "native"]
    return [name for name in names if cost_model.unsupported(name, axis_sizes) is None]


def rank_schedules(
    nbytes: float, axis_sizes: Sequence[int], links: Links
) -> list[tuple[str, float, float]]:
    """``(schedule, predicted seconds, bytes each device sends)`` for an allreduce of
    ``nbytes``, cheapest first (ties keep the family's order)."""
    runnable = runnable_schedules(axis_sizes)
    if not runnable:
        raise ValueError(
            f"no schedule of the family can run over data axes of sizes {tuple(axis_sizes)}"
        )
    ranked = []
    for name in runnable:
        network = links.for_schedule(name)
        seconds = cost_model.predict(name, nbytes, axis_sizes, network)
        sent = sum(t.volume for t in cost_model.terms(name, axis_sizes)) * nbytes
        ranked.append((name, seconds, sent))
    return sorted(ranked, key=lambda row: row[1])


def factor_gather_terms(axis_sizes: Sequence[int]) -> list[Term]:
    """Cost terms of a ring all-gather of ``S`` bytes per device over all ``R`` devices:
    ``R - 1`` steps, ``(R - 1) S`` bytes received (and sent) by each. Over two axes it runs
    every step over the slowest link it crosses, like a one-dimensional schedule."""
    sizes = tuple(int(s) for s in axis_sizes)
    devices = math.prod(sizes)
    return [Term(flat_link_class(sizes), devices - 1, devices - 1)] if devices > 1 else []


def rebuild_seconds(rows: int, m: int, n: int, axis_sizes: Sequence[int], links: Links) -> float:
    """Seconds a device spends rebuilding an ``m x n`` gradient from all devices' ``rows`` rows
    of factors, beyond the local gradient it no longer forms (0 without ``links.flops``)."""
    if links.flops is None:
        return 0.0
    return 2 * (math.prod(axis_sizes) - 1) * rows * m * n / links.flops


def predict_factor_gather(nbytes: float, axis_sizes: Sequence[int], links: Links) -> float:
    """Predicted seconds to all-gather ``nbytes`` of factors from every device."""
    return cost_model.price(factor_gather_terms(axis_sizes), nbytes, links.flat)


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    """How one gradient travels: a bucket or a dense layer, its bytes, the chosen path
    (a schedule or :data:`FACTORS`), its predicted seconds and the bytes each device sends, and
    the runner-up with its prediction. Predictions are ``None`` when no links are known.
    A dense layer that stays :data:`DENSE` is priced alone for the comparison but travels in a
    bucket, so it is left out of the totals (``in_total=False``)."""

    name: str
    detail: str
    nbytes: int
    choice: str
    seconds: float | None = None
    sent_bytes: float | None = None
    runner_up: str | None = None
    runner_up_seconds: float | None = None
    in_total: bool = True


def route_bucket(
    name: str, detail: str, nbytes: int, axis_sizes: Sequence[int], links: Links
) -> Route:
    """The cheapest schedule for a bucket of ``nbytes``."""
    (best, seconds, sent), *rest = rank_schedules(nbytes, axis_sizes, links)
    runner = rest[0] if rest else (None, None, None)
    return Route(name, detail, nbytes, best, seconds, sent, runner[0], runner[1])


def route_dense_layer(
    name: str,
    detail: str,
    kernel_bytes: int,
    factor_bytes: int,
    axis_sizes: Sequence[int],
    links: Links,
    *,
    allow_dense: bool = True,
    rebuild: float = 0.0,
) -> Route:
    """Factors or the dense gradient for one dense layer: a ring all-gather of
    ``factor_bytes`` per device plus ``rebuild`` seconds (:func:`rebuild_seconds`) against the
    cheapest schedule for ``kernel_bytes`` alone (``allow_dense=False``: factors, whatever the
    prices)."""
    gather = predict_factor_gather(factor_bytes, axis_sizes, links) + rebuild
    gather_sent = sum(t.volume for t in factor_gather_terms(axis_sizes)) * factor_bytes
    schedule, dense_seconds, dense_sent = rank_schedules(kernel_bytes, axis_sizes, links)[0]
    if gather <= dense_seconds or not allow_dense:
        return Route(
            name, detail, factor_bytes, FACTORS, gather, gather_sent, schedule, dense_seconds
        )
    return Route(
        name,
        detail,
        kernel_bytes,
        DENSE,
        dense_seconds,
        dense_sent,
        FACTORS,
        gather,
        in_total=False,
    )


def format_routes(routes: Sequence[Route], links: Links | None = None) -> str:
    """The plan as a table: one row per bucket or dense layer, then the totals."""

    def mib(nbytes):
        if nbytes is None:
            return "-"
        return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"

    def ms(seconds):
        return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"

    header = ("gradient", "what", "bytes", "route", "predicted", "sends", "runner-up")
    rows = [header]
    for r in routes:
        runner = "-" if r.runner_up is None else f"{r.runner_up} {ms(r.runner_up_seconds)}"
        rows.append(
            (r.name, r.detail, mib(r.nbytes), r.choice, ms(r.seconds), mib(r.sent_bytes), runner)
        )
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    counted = [r for r in routes if r.in_total]
    priced = [r.seconds for r in counted if r.seconds is not None]
    if len(priced) == len(counted) and counted:
        sent = sum(r.sent_bytes for r in counted)
        lines.append(
            f"total: {ms(sum(priced))} predicted, {mib(sent)} sent per device"
            + (f" (links: {links.source})" if links is not None else "")
        )
    return "\n".join(lines)
