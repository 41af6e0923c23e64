"""Collective benchmark in the spirit of nccl-tests.

For every (size, algorithm) it runs an allreduce of ``size`` bytes per device on a mesh,
checks the result against ``psum``, and reports the median time after warm-up, algbw and busbw
(allreduce factor 2(p-1)/p), the time as a ratio to ``psum`` measured in the same run, and the
alpha-beta cost model's prediction. The model's ``alpha`` and ``beta`` are fitted from a
point-to-point ``ppermute`` shift measured in the same run, so no figure is assumed.

Works unchanged on one process or many (inputs are built per addressable shard; only
process 0 prints).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.bench.sizes import format_size
from jaxdist.comm import collectives, cost_model

__all__ = [
    "Result",
    "Row",
    "make_input",
    "per_device",
    "run",
]


@dataclass
class Row:
    """One measured (size, algorithm) point."""

    nbytes: int
    algorithm: str
    seconds: float  # median over timed iterations
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    vs_psum: float  # seconds / psum's seconds at this size
    max_error: float  # max |result - psum| over all elements and devices
    predicted_seconds: float
    compile_seconds: float
    link_share: float | None = None  # busbw / the link rate, when the rate is known


@dataclass
class Result:
    mesh: str
    axis_sizes: tuple[int, ...]
    devices: int
    platform: str
    dtype: str
    in_place: bool
    link: cost_model.Link
    rows: list[Row]
    skipped: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)  # the schedule options of the run
    op: str = "sum"
    link_rate: float | None = None  # bytes/s per direction of a device's link, when known
    # On a mesh of two axes (both > 1): the links along each, which price the two-level
    # schedules (``link`` prices the others).
    axis_links: cost_model.Network | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["link"] = _link_json(self.link)
        out.pop("axis_links")
        if self.axis_links is not None:
            out["intra_link"] = _link_json(self.axis_links.intra)
            out["inter_link"] = _link_json(self.axis_links.inter)
        return out


def _link_json(link: cost_model.Link) -> dict:
    return {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "ports": link.ports}


def priced_on(
    algorithm: str, link: cost_model.Link, axis_links: cost_model.Network | None
) -> cost_model.Link | cost_model.Network:
    """The links the cost model prices ``algorithm`` on in a run: the two-level schedules on
    the links fitted along each axis where there are some, the rest on the shift round all
    devices (see :func:`run`)."""
    two_level = collectives.get(algorithm).two_level
    return axis_links if two_level and axis_links is not None else link


def default_ports(platform: str) -> int:
    """Messages a device can send at full rate at once, as the cost model assumes by default:
    two on TPU (a separate ICI link to each ring neighbour), one elsewhere (one NIC per host,
    one NVLink/NVSwitch port budget per GPU, or one memory bus for forced CPU devices)."""
    return 2 if platform == "tpu" else 1


def skip_reason(algorithm: str, mesh: Mesh, inter_algorithm: str = "ring") -> str | None:
    """Why ``algorithm`` cannot run on ``mesh`` (``hierarchical``: with ``inter_algorithm``
    across the outer axis), or None."""
    return cost_model.unsupported(algorithm, mesh.devices.shape, inter_algorithm=inter_algorithm)


def _timed(fn: Callable, arg, warmup: int, iters: int, in_place: bool) -> tuple[float, float]:
    """(compile seconds, median run seconds) of ``fn(arg)``.

    In place, ``fn`` donates its input (as a train step hands over its gradient buffers), so
    every call gets a fresh copy made outside the timed region.
    """
    start = time.perf_counter()
    compiled = fn.lower(arg).compile()
    compile_seconds = time.perf_counter() - start

    def fresh():
        return jax.block_until_ready(jnp.copy(arg)) if in_place else arg

    for _ in range(warmup):
        jax.block_until_ready(compiled(fresh()))
    times = []
    for _ in range(iters):
        x = fresh()
        start = time.perf_counter()
        jax.block_until_ready(compiled(x))
        times.append(time.perf_counter() - start)
    return compile_seconds, statistics.median(times)


def make_input(mesh: Mesh, count: int, dtype, seed: int) -> jax.Array:
    """A (devices, count) array of random normals, one row per device, sharded over all of
    ``mesh``'s axes and built shard by shard (multi-process safe)."""
    names = tuple(mesh.axis_names)
    sharding = NamedSharding(mesh, P(names))
    shape = (mesh.size, count)

    def shard(index):
        rows = range(*index[0].indices(mesh.size))
        data = np.stack([np.random.default_rng(seed + r).standard_normal(count) for r in rows])
        return data.astype(dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


def per_device(mesh: Mesh, body: Callable, donate: bool = False) -> Callable:
    """``jit`` of ``body`` on each device's row of a :func:`make_input` array (a ``shard_map``
    over all of ``mesh``'s axes); ``donate`` hands the input's buffer to the call."""
    names = tuple(mesh.axis_names)
    return jax.jit(
        jax.shard_map(lambda x: body(x[0])[None], mesh=mesh, in_specs=P(names), out_specs=P(names)),
        donate_argnums=(0,) if donate else (),
    )


@dataclass(frozen=True)
class _Settings:
    """What every step of one :func:`run` shares."""

    mesh: Mesh
    dtype: np.dtype
    warmup: int
    iters: int
    options: dict
    op: str
    in_place: bool
    say: Callable[[str], None]

    @property
    def flat_axes(self) -> str | tuple[str, ...]:
        """The mesh's axes as the schedules read them: two-level ones as (outer, inner), the
        others as one flattened axis."""
        names = tuple(self.mesh.axis_names)
        return names[0] if len(names) == 1 else names


def run(
    mesh: Mesh,
    sizes: Sequence[int],
    algorithms: Sequence[str] = collectives.ALGORITHMS,
    *,
    dtype=jnp.float32,
    warmup: int = 2,
    iters: int = 5,
    mesh_name: str = "",
    options: dict | None = None,
    in_place: bool = False,
    op: str = "sum",
    ports: int | None = None,
    link_rate: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """Measure ``algorithms`` at each of ``sizes`` (bytes per device) on ``mesh``.

    Out of place (default) the input stays valid and the result goes to a new buffer; in place
    the input is donated, so a schedule may write its result over it (nccl-tests reports both).
    ``op="mean"`` times the mean (as a train step averages gradients) against ``pmean``.
    ``ports`` is the fitted link's port count for the cost model (``None``:
    :func:`default_ports` of the mesh's platform). ``link_rate`` (bytes/s per direction of a
    device's link) adds every row's busbw as a share of it, as nccl-tests' busbw is read.
    """
    collectives.check_names(algorithms)
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    options = options or {}
    settings = _Settings(
        mesh, jnp.dtype(dtype), warmup, iters, options, op, in_place, progress or (lambda _: None)
    )
    platform = mesh.devices.flat[0].platform
    runnable, skipped = _runnable(algorithms, mesh, options.get("inter_algorithm", "ring"))
    ports = default_ports(platform) if ports is None else ports
    link, axis_links = _fit_links(settings, sizes, runnable, ports)
    measured = _measure(settings, sizes, runnable)
    rows = [
        _row(
            settings, nbytes, algorithm, measured, priced_on(algorithm, link, axis_links), link_rate
        )
        for (nbytes, algorithm) in measured
        if algorithm in algorithms
    ]
    return Result(
        mesh=mesh_name,
        axis_sizes=tuple(mesh.devices.shape),
        devices=mesh.size,
        platform=platform,
        dtype=str(settings.dtype),
        in_place=in_place,
        op=op,
        link_rate=link_rate,
        link=link,
        axis_links=axis_links,
        rows=rows,
        skipped=skipped,
        # JSON keeps numbers, strings and None; anything else (a dtype) as its name.
        options={
            k: v if isinstance(v, int | float | str | None) else str(v) for k, v in options.items()
        },
    )


def _runnable(
    algorithms: Sequence[str], mesh: Mesh, inter_algorithm: str
) -> tuple[list[str], dict[str, str]]:
    """The algorithms that can run on ``mesh`` (psum first if it was not asked for: every row
    is a ratio to it), and why each of the others cannot."""
    skipped = {a: r for a in algorithms if (r := skip_reason(a, mesh, inter_algorithm))}
    runnable = [a for a in algorithms if a not in skipped]
    if "native" not in runnable:
        runnable = ["native", *runnable]
    return runnable, skipped


def _fit_links(
    settings: _Settings, sizes: Sequence[int], runnable: Sequence[str], ports: int
) -> tuple[cost_model.Link, cost_model.Network | None]:
    """The links the cost model prices the run on, fitted from ppermute shifts timed here.

    One-axis schedules: a shift round all devices (on a two-axis mesh its slowest hops set the
    pace, as they set the schedule's). Two-level schedules: each axis's own links, every device
    sending at once (so devices that share a host's network card share it here too).
    """
    mesh = settings.mesh
    link = _fitted_link(
        settings,
        sizes,
        ports,
        settings.flat_axes,
        mesh.size,
        "point-to-point link round all devices",
    )
    names = tuple(mesh.axis_names)
    if not (
        any(collectives.get(a).two_level for a in runnable)
        and len(names) == 2
        and min(mesh.devices.shape) > 1
    ):
        return link, None
    (outer, inner), (outer_size, inner_size) = names, mesh.devices.shape
    return link, cost_model.Network(
        intra=_fitted_link(
            settings, sizes, ports, inner, inner_size, f"links along the inner axis {inner!r}"
        ),
        inter=_fitted_link(
            settings, sizes, ports, outer, outer_size, f"links along the outer axis {outer!r}"
        ),
    )


def _fitted_link(
    settings: _Settings, sizes: Sequence[int], ports: int, axes, n: int, what: str
) -> cost_model.Link:
    """One link fitted from a ppermute shift round a ring of ``n`` devices along ``axes``,
    timed at every benchmark size plus two fixed ones, so that a fit is possible even for one
    size. The shift goes as the schedules send it: on two devices it is an exchange."""
    pieces = settings.options.get("exchange_piece_bytes", "auto")
    ring = [(j, (j + 1) % n) for j in range(n)]
    shift = per_device(
        settings.mesh,
        lambda v: collectives.permute(v, axes, ring, exchange_piece_bytes=pieces),
    )
    fit_sizes = sorted(set(sizes) | {2**10, 2**20})
    times = []
    for nbytes in fit_sizes:
        count = max(1, nbytes // settings.dtype.itemsize)
        x = make_input(settings.mesh, count, settings.dtype, seed=nbytes)
        times.append(_timed(shift, x, settings.warmup, settings.iters, False)[1])
    link = cost_model.fit("p2p", (n,), fit_sizes, times, ports=ports)
    settings.say(
        f"  {what}: alpha {link.alpha * 1e6:.1f} us, {link.bandwidth / 1e9:.2f} GB/s, "
        f"{link.ports} port(s)"
    )
    return link


def _measure(
    settings: _Settings, sizes: Sequence[int], runnable: Sequence[str]
) -> dict[tuple[int, str], tuple[float, float, float]]:
    """``(bytes, algorithm) -> (median seconds, max error against psum, compile seconds)``."""
    axes, op, options = settings.flat_axes, settings.op, settings.options
    max_error = jax.jit(
        lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
    )
    psum_or_pmean = jax.lax.pmean if op == "mean" else jax.lax.psum
    measured = {}
    for nbytes in sizes:
        count = max(1, nbytes // settings.dtype.itemsize)
        x = make_input(settings.mesh, count, settings.dtype, seed=nbytes)
        reference = per_device(settings.mesh, lambda v: psum_or_pmean(v, axes))(x)
        for algorithm in runnable:
            accepted = collectives.get(algorithm).option_names
            opts = {k: v for k, v in options.items() if k in accepted}
            fn = per_device(
                settings.mesh,
                lambda v, a=algorithm, o=opts: collectives.allreduce(v, axes, a, op=op, **o),
                donate=settings.in_place,
            )
            compile_s, seconds = _timed(fn, x, settings.warmup, settings.iters, settings.in_place)
            err = float(max_error(fn(jnp.copy(x)), reference))
            measured[(nbytes, algorithm)] = (seconds, err, compile_s)
            settings.say(f"  {format_size(nbytes):>6s} {algorithm:<20s} {seconds * 1e6:12.1f} us")
        del x, reference
    return measured


def _row(
    settings: _Settings,
    nbytes: int,
    algorithm: str,
    measured: dict[tuple[int, str], tuple[float, float, float]],
    links: cost_model.Link | cost_model.Network,
    link_rate: float | None,
) -> Row:
    """One table row: the measurement, its bandwidths and the cost model's prediction."""
    seconds, err, compile_s = measured[(nbytes, algorithm)]
    algbw, busbw = cost_model.bus_bandwidth(nbytes, seconds, settings.mesh.size)
    predicted = cost_model.predict(
        algorithm,
        nbytes,
        settings.mesh.devices.shape,
        links,
        inter_algorithm=settings.options.get("inter_algorithm", "ring"),
        crossed_exchange=settings.options.get("crossed_exchange"),
    )
    return Row(
        nbytes=nbytes,
        algorithm=algorithm,
        seconds=seconds,
        algbw=algbw,
        busbw=busbw,
        vs_psum=seconds / measured[(nbytes, "native")][0],
        max_error=err,
        predicted_seconds=predicted,
        compile_seconds=compile_s,
        link_share=busbw / link_rate if link_rate else None,
    )
