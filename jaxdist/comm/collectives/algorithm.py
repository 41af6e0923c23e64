"""One record per allreduce algorithm: its name, schedule, cost terms, requirements and options.

Every schedule module ends with its :class:`Algorithm`; the registry
(:mod:`~jaxdist.comm.collectives.registry`) collects them, and everything that needs to know
what an algorithm can run on or what it costs (the cost model, the train step, the
benchmarks, the command line) asks the record instead of keeping its own copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jaxdist.comm.collectives.wire import UNROLL_LIMIT

__all__ = [
    "Algorithm",
    "Term",
]

# Options every schedule takes, with their defaults (see allreduce): the largest message a
# pairwise exchange sends at once, and how many steps are unrolled before they loop.
COMMON_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {"exchange_piece_bytes": "auto", "unroll_limit": UNROLL_LIMIT}
)


@dataclass(frozen=True)
class Term:
    """One part of a schedule's cost: ``steps`` sequential steps of ``lanes`` messages each that
    could travel at once, and ``volume * S`` bytes sent in all (over every lane) over
    ``link_class`` (``"intra"``: the inner axis, inside a host; ``"inter"``: the outer axis,
    between hosts)."""

    link_class: str
    steps: float
    volume: float
    lanes: int = 1

    def cost_factors(self, ports: int) -> tuple[float, float]:
        """(messages paid in sequence, multiple of ``S`` sent in sequence) on a link that
        sends ``ports`` messages at once: the multipliers of ``alpha`` and ``S * beta``."""
        concurrent = min(self.lanes, ports)
        return self.steps * math.ceil(self.lanes / ports), self.volume / concurrent


def flat_link_class(axis_sizes: Sequence[int]) -> str:
    """The link class a one-dimensional schedule over ``axis_sizes`` is priced on: it runs
    every step over the slowest link it crosses, ``"inter"`` unless the outer axis has a single
    device."""
    return "inter" if len(axis_sizes) == 2 and axis_sizes[0] > 1 else "intra"


@dataclass(frozen=True)
class Algorithm:
    """An allreduce algorithm.

    Attributes:
      name: the name users pass (``allreduce(..., "ring")``, ``Communication("ring")``).
      summary: one line on what it does.
      schedule: ``schedule(flat, axis_name, run, **options) -> flat sum``, run inside
        shard_map on a flat buffer in the accumulation dtype; ``run`` is a
        :class:`~jaxdist.comm.collectives.wire.Run`.
      cost: the alpha-beta cost terms. One-dimensional: ``cost(p, link_class)`` for ``p``
        devices on links of ``link_class``; on several levels: ``cost(axis_sizes,
        **options)``, sizes outer to inner.
      levels: the mesh axes it runs on as levels of its own: 1 for one axis (or a tuple of
        axes acting as one flattened axis), 2 for ``(outer, inner)``, 3 for ``(outer,
        middle, inner)``.
      power_of_two: needs a power-of-two number of devices.
      swaps_on_two: on an axis of two devices its whole schedule is one pairwise swap.
      options: its own keyword options and their defaults (besides :data:`COMMON_OPTIONS`).
      check_options: further requirements on the mesh and options: ``(axis_sizes, options)
        -> reason or None``.
    """

    name: str
    summary: str
    schedule: Callable[..., Any]
    cost: Callable[..., list[Term]]
    levels: int = 1
    power_of_two: bool = False
    swaps_on_two: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    check_options: Callable[[tuple[int, ...], Mapping[str, Any]], str | None] | None = None

    @property
    def two_level(self) -> bool:
        """Whether it runs on a tuple of two axes ``(outer, inner)``."""
        return self.levels == 2

    def axes_needed(self, noun: str = "axes") -> str:
        """The axes it runs on, in words, for error messages: ``"two axes (outer, inner)"``
        (``noun`` in place of ``axes``)."""
        if self.levels == 1:
            return "one axis"
        word, names = {2: ("two", "(outer, inner)"), 3: ("three", "(outer, middle, inner)")}[
            self.levels
        ]
        return f"{word} {noun} {names}"

    @property
    def option_names(self) -> tuple[str, ...]:
        """Every keyword option :func:`~jaxdist.comm.collectives.allreduce` takes for it."""
        return (*COMMON_OPTIONS, *self.options)

    def resolve(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with this algorithm's own defaults filled in; a ``TypeError`` names any
        option it does not take."""
        unknown = set(options) - set(self.options) - set(COMMON_OPTIONS)
        if unknown:
            accepted = sorted({*self.options, *COMMON_OPTIONS})
            raise TypeError(
                f"allreduce algorithm {self.name!r}: bad options {sorted(unknown)}; "
                f"it takes {accepted}"
            )
        return {**self.options, **{k: v for k, v in options.items() if k in self.options}}

    def unsupported(self, axis_sizes: Sequence[int], **options: Any) -> str | None:
        """Why this algorithm cannot run on a mesh with ``axis_sizes`` (outer to inner) with
        ``options``, or None."""
        sizes = tuple(int(s) for s in axis_sizes)
        if self.levels > 1 and len(sizes) != self.levels:
            return f"needs a {self.levels}-axis mesh, got axis sizes {sizes}"
        p = math.prod(sizes)
        if self.power_of_two and p & (p - 1):
            return f"needs a power-of-two device count, got {p}"
        if self.check_options is not None:
            return self.check_options(sizes, self.resolve(options))
        return None

    def terms(self, axis_sizes: Sequence[int], **options: Any) -> list[Term]:
        """The cost terms on a mesh with ``axis_sizes`` (outer to inner).

        A one-dimensional schedule that spans a two-axis mesh runs every step over the slowest
        link it crosses, so it is priced on ``"inter"`` links unless the outer axis has a
        single device.
        """
        sizes = tuple(int(s) for s in axis_sizes)
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"axis sizes must be positive integers, got {tuple(axis_sizes)!r}")
        if self.levels > 1 and len(sizes) != self.levels:
            raise ValueError(f"{self.name} needs {self.axes_needed()}, got sizes {sizes}")
        reason = self.unsupported(sizes, **options)
        if reason:
            raise ValueError(f"{self.name} cannot run here: {reason}")
        if self.levels > 1:
            return self.cost(sizes, **self.resolve(options))
        return self.cost(math.prod(sizes), flat_link_class(sizes))
