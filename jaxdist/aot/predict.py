"""Step time and time-to-train from a compiled step, a chip's figures and the cost model.

A step takes its compute, the gradient communication that backward cannot hide, and every
other collective of the compiled program::

    compute  = FLOPs per chip / (peak FLOP/s x efficiency)
    comm     = sum over gradient buckets of the cost model's allreduce time on the links
               (native and a published run: the compiler's or library's own all-reduce,
               :func:`library_allreduce_seconds`)
    hidden   = min(comm - last bucket, backward x share of backward run while gradients move)
    other    = sum over the program's other collectives (BatchNorm statistics, metrics, ...)
               of the cost model's time for their kind, bytes and group, each run as often
               as the program runs it
    step     = compute + comm - hidden + other

* ``efficiency`` is the share of peak a real step reaches. It is not derived: it is
  calibrated on a published run (:mod:`jaxdist.aot.published`) and printed with every
  prediction.
* backward is :data:`BACKWARD_SHARE` of the compute (two of the three matrix products per
  layer); the share of it that runs while a gradient collective is in flight is read from
  the compiled schedule, so a program whose collectives wait for the whole backward pass, or
  run inside a loop, hides nothing. The last bucket always waits for the end of backward.

The other collectives are counted as exposed: a BatchNorm's statistics are needed by the
very next op, and the rest are small. Input reading, evaluation and start-up are outside the
model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxdist.aot.chips import Chip
from jaxdist.aot.compile import CompiledStep
from jaxdist.aot.schedule import Collective, Schedule
from jaxdist.comm import cost_model
from jaxdist.training.batch_schedule import BatchSchedule

__all__ = [
    "StepTime",
    "library_allreduce_seconds",
    "predict_step",
    "step_time",
    "time_to_train",
]

BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and its parts."""

    compute: float
    communication: float  # the gradients'
    hidden: float
    efficiency: float
    # Seconds of every other collective of the program, all exposed, by role.
    other_by_role: dict[str, float] = field(default_factory=dict)

    @property
    def other(self) -> float:
        return sum(self.other_by_role.values())

    @property
    def exposed(self) -> float:
        """Communication the step waits for: the gradients' unhidden part and the rest."""
        return self.communication - self.hidden + self.other

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def communication_seconds(
    bucket_bytes: Sequence[float],
    algorithm: str,
    axis_sizes: Sequence[int],
    network: cost_model.Network,
    *,
    per_host: int | None = None,
    torus_dims: int = 0,
) -> list[float]:
    """The cost model's seconds for each gradient bucket. ``native`` (``lax.psum``) is the
    compiler's own all-reduce, priced as :func:`library_allreduce_seconds` over hosts (or
    slices) of ``per_host`` devices (default: one host)."""
    if algorithm == "none":
        return [0.0 for _ in bucket_bytes]
    if algorithm == "native":
        devices = math.prod(axis_sizes)
        group = min(per_host or devices, devices)
        return [
            library_allreduce_seconds(b, devices, group, network, torus_dims) for b in bucket_bytes
        ]
    return [cost_model.predict(algorithm, b, axis_sizes, network) for b in bucket_bytes]


def collective_seconds(collective: Collective, link: cost_model.Link, torus_dims: int = 0) -> float:
    """The cost model's seconds for one run of a collective of ``g`` devices over ``link``.

    A permute is one message; an all-reduce is :func:`all_reduce_seconds`; an all-gather, a
    reduce-scatter and an all-to-all take ``g - 1`` messages of one device's part."""
    g, nbytes = max(collective.group_size, 1), collective.nbytes
    if collective.kind == "collective-permute":
        return link.alpha + nbytes * link.beta
    if g == 1:
        return 0.0
    if collective.kind == "all-reduce":
        return all_reduce_seconds(g, nbytes, link, torus_dims)
    part = nbytes if collective.kind == "reduce-scatter" else nbytes / g
    return (g - 1) * (link.alpha + part * link.beta)


def all_reduce_seconds(g: int, nbytes: float, link: cost_model.Link, torus_dims: int = 0) -> float:
    """Seconds of the compiler's or the library's all-reduce of ``nbytes`` per device over
    ``g`` devices joined by ``link``.

    XLA's all-reduce on a TPU's torus runs as rings along each of its ``torus_dims``
    dimensions (a group of ``g`` chips spans about ``g ** (1/d)`` along each), so
    ``2 d (g^(1/d) - 1)`` messages and a ring's bytes over the ports. Elsewhere (NCCL) it is
    the cheaper of a ring (``2(g - 1)`` messages of ``S/g``) and a tree (``2 log2 g``
    messages of ``S``)."""
    if g <= 1:
        return 0.0
    if torus_dims:
        per_dimension = math.ceil(round(g ** (1 / torus_dims), 9))
        steps = 2 * torus_dims * (per_dimension - 1)
        return steps * link.alpha + 2 * (g - 1) / g * nbytes * link.beta / link.ports
    ring = cost_model.predict("ring", nbytes, [g], link)
    tree = 2 * math.log2(g) * (link.alpha + nbytes * link.beta)
    return min(ring, tree)


def library_allreduce_seconds(
    nbytes: float, devices: int, per_host: int, network: cost_model.Network, torus_dims: int = 0
) -> float:
    """Seconds of an all-reduce the compiler or the vendor's library runs on its own (``lax.psum``
    on a TPU slice, NCCL on GPU hosts), of ``nbytes`` per device over ``devices``.

    Without a host network (one TPU slice) it is one :func:`all_reduce_seconds` over the
    torus. With one, it is two-level, as NCCL (and XLA across slices) runs it: inside each
    host (or slice) of ``per_host`` devices a reduce-scatter and an all-gather on the fast
    links, together one :func:`all_reduce_seconds` there; between them an all-reduce of each
    device's ``1/per_host`` part, the cheaper of a ring and a tree."""
    if network.inter is None:
        return all_reduce_seconds(devices, nbytes, network.intra, torus_dims)
    inside = all_reduce_seconds(per_host, nbytes, network.intra, torus_dims)
    hosts = max(devices // per_host, 1)
    return inside + all_reduce_seconds(hosts, nbytes / per_host, network.inter)


def other_collective_seconds(
    schedule: Schedule, network: cost_model.Network, fast_group: float, torus_dims: int = 0
) -> dict[str, float]:
    """Seconds per step of each role's collectives other than the gradients', each run as
    many times as the program runs it. A group larger than ``fast_group`` devices (a TPU
    slice, a GPU host) crosses the slow network; inside it, ``torus_dims`` says how XLA's
    all-reduce runs (:func:`collective_seconds`)."""
    seconds: dict[str, float] = {}
    for c in schedule.collectives:
        if c.role == "gradients":
            continue
        crosses = c.group_size > fast_group
        link = network.link("inter" if crosses else "intra")
        one = collective_seconds(c, link, 0 if crosses else torus_dims)
        seconds[c.role] = seconds.get(c.role, 0.0) + c.turns * one
    return seconds


def step_time(
    compute: float,
    per_bucket: Sequence[float],
    overlapped_backward_fraction: float,
    efficiency: float,
    other_by_role: dict[str, float] | None = None,
) -> StepTime:
    """The step from its parts: the rule every prediction here uses, for a compiled plan and
    for a published run alike. Backward is :data:`BACKWARD_SHARE` of ``compute``; the
    gradient buckets' seconds hide behind the part of it that runs beside them, except the
    last bucket's, which waits for the end of backward."""
    communication = sum(per_bucket)
    backward = compute * BACKWARD_SHARE * overlapped_backward_fraction
    hidden = max(0.0, min(communication - per_bucket[-1], backward)) if per_bucket else 0.0
    return StepTime(compute, communication, hidden, efficiency, dict(other_by_role or {}))


def predict_step(
    compiled: CompiledStep,
    chip: Chip,
    *,
    efficiency: float,
    algorithm: str,
    axis_sizes: Sequence[int],
    network: cost_model.Network,
    fast_group: int | None = None,
) -> StepTime:
    """The :class:`StepTime` of a compiled step on ``chip``; ``fast_group`` is how many
    devices the fast links join (default: all of them)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    compute = compiled.flops / (chip.peak_flops * efficiency)
    per_bucket = communication_seconds(
        compiled.bucket_bytes, algorithm, axis_sizes, network,
        per_host=fast_group, torus_dims=chip.torus_dims,
    )  # fmt: skip
    other = other_collective_seconds(
        compiled.schedule, network, fast_group if fast_group is not None else math.inf,
        chip.torus_dims,
    )  # fmt: skip
    overlap = compiled.schedule.overlapped_backward_fraction
    return step_time(compute, per_bucket, overlap, efficiency, other)


def time_to_train(
    schedule: BatchSchedule, epochs: float, step_seconds: Sequence[float]
) -> list[dict]:
    """Per batch-size stage: its steps, step time, images/s and seconds, over ``epochs``;
    ``step_seconds[i]`` is stage ``i``'s predicted step time."""
    end = schedule.steps_for_epochs(epochs)
    starts = [first for first, _ in schedule.stage_boundaries()] + [end]
    rows = []
    for i, (first, stage) in enumerate(schedule.stage_boundaries()):
        steps = max(0, min(starts[i + 1], end) - min(first, end))
        seconds = steps * step_seconds[i]
        rows.append({
            "stage": i,
            "global_batch": stage.global_batch_size,
            "steps": steps,
            "step_seconds": step_seconds[i],
            "images_per_second": stage.global_batch_size / step_seconds[i],
            "seconds": seconds,
        })  # fmt: skip
    return rows
