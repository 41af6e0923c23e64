"""Step time and time-to-train from a compiled step, a chip's figures and the cost model.

A compiled step is walked in the order its compiler chose (:mod:`jaxdist.aot.timeline`)::

    compute  = FLOPs per chip / (peak FLOP/s x efficiency), spread over the program's
               compute ops by their roofline time
    each collective: the cost model's time for its kind, bytes and group on the links it
               crosses (an all-reduce: the compiler's or library's own,
               :func:`all_reduce_seconds`), one at a time on the network (but for
               permutes, one per link port of the chip at once); an asynchronous one runs
               beside whatever compute the program places before its done
    step     = the end of the walk: compute and every wait for a collective
    hidden   = the part of the gradient collectives' time the compute stream ran beside

* ``efficiency`` is the share of peak a real step reaches. It is not derived: it is
  calibrated on published runs (:mod:`jaxdist.aot.published`) and printed with every
  prediction.
* A program whose gradient collectives run after backward, or inside a loop, hides nothing
  of them, however many backward ops sit inside one of their start...done windows.

A published run has no compiled program of its own: :func:`step_time` prices its gradient
buckets and hides the share of their time that the walk of a compiled ResNet-50 step hid.
Input reading, evaluation and start-up are outside the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxdist.aot.chips import Chip
from jaxdist.aot.compile import CompiledStep
from jaxdist.aot.schedule import Collective, Instruction, source_target_pairs
from jaxdist.aot.timeline import Timeline, walk
from jaxdist.comm import cost_model
from jaxdist.training.batch_schedule import BatchSchedule

__all__ = [
    "StepTime",
    "library_allreduce_seconds",
    "predict_step",
    "step_time",
    "time_to_train",
    "transfer_pricer",
]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and its parts."""

    compute: float
    communication: float  # the gradients'
    hidden: float  # of the gradients' communication, the part compute ran beside
    efficiency: float
    # Seconds of every other collective of the program, by role.
    other_by_role: dict[str, float] = field(default_factory=dict)
    # The walk of the compiled program, when there is one (else the parts add up).
    timeline: Timeline | None = None

    @property
    def other(self) -> float:
        return sum(self.other_by_role.values())

    @property
    def hidden_fraction(self) -> float:
        """Share of the gradient communication's time that compute hides."""
        return self.hidden / self.communication if self.communication else 0.0

    @property
    def parameter_communication(self) -> float:
        """Seconds of a sharded step's parameter gathers (walked steps only)."""
        return self.timeline.parameter_seconds if self.timeline is not None else 0.0

    @property
    def parameter_hidden(self) -> float:
        return self.timeline.parameter_hidden_seconds if self.timeline is not None else 0.0

    @property
    def tensor_communication(self) -> float:
        """Seconds of a tensor-parallel step's summed products' transfers (walked steps)."""
        return self.other_by_role.get("tensor", 0.0)

    @property
    def tensor_hidden(self) -> float:
        """Of :attr:`tensor_communication`, the part compute ran beside."""
        if self.timeline is None:
            return 0.0
        return self.timeline.other_hidden_seconds.get("tensor", 0.0)

    @property
    def exposed(self) -> float:
        """Time the step waits for communication."""
        if self.timeline is not None:
            return self.timeline.exposed_seconds
        return (
            self.communication
            - self.hidden
            + self.other
            + self.parameter_communication
            - self.parameter_hidden
        )

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


def step_time(
    compute: float,
    per_bucket: Sequence[float],
    hidden_fraction: float,
    efficiency: float,
    other_by_role: dict[str, float] | None = None,
) -> StepTime:
    """A step from its parts, for a run with no compiled program of its own (a published
    run): the gradient buckets' seconds, of which ``hidden_fraction`` hides behind compute
    (the share a walked program hid, :attr:`Timeline.gradient_hidden_fraction`)."""
    communication = sum(per_bucket)
    hidden = communication * min(max(hidden_fraction, 0.0), 1.0)
    return StepTime(compute, communication, hidden, efficiency, dict(other_by_role or {}))


def transfer_pricer(network: cost_model.Network, fast_group: float = math.inf, torus_dims: int = 0):
    """``price(collective, instruction) -> seconds`` of one run of a compiled collective on
    ``network``: over the host network when it joins devices of different groups of
    ``fast_group`` (a permute: any of its pairs; the rest: a group larger than one), else
    over the fast links; an all-reduce across groups as the library runs it
    (:func:`library_allreduce_seconds`)."""

    def price(collective: Collective, inst: Instruction) -> float:
        if collective.kind == "collective-permute":
            pairs = source_target_pairs(inst)
            crosses = any(a // fast_group != b // fast_group for a, b in pairs)
        else:
            crosses = collective.group_size > fast_group
        if crosses and collective.kind == "all-reduce" and network.inter is not None:
            return library_allreduce_seconds(
                collective.nbytes, collective.group_size, int(fast_group), network, torus_dims
            )
        link = network.link("inter" if crosses else "intra")
        return collective_seconds(collective, link, 0 if crosses else torus_dims)

    return price


def predict_step(
    compiled: CompiledStep,
    chip: Chip,
    *,
    efficiency: float,
    network: cost_model.Network,
    fast_group: int | None = None,
) -> StepTime:
    """The :class:`StepTime` of a compiled step on ``chip``; ``fast_group`` is how many
    devices the fast links join (default: all of them)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    compute = compiled.flops / (chip.peak_flops * efficiency)
    price = transfer_pricer(
        network, fast_group if fast_group is not None else math.inf, chip.torus_dims
    )
    timeline = walk(
        compiled.text,
        compute,
        price,
        peak_flops=chip.peak_flops,
        hbm_bandwidth=chip.hbm_bandwidth,
        num_devices=compiled.num_devices,
        scatter_roles=compiled.scatter_roles,
        ports=network.intra.ports,
    )
    return StepTime(
        compute,
        timeline.gradient_seconds,
        timeline.gradient_hidden_seconds,
        efficiency,
        dict(timeline.other_seconds),
        timeline,
    )


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
        rows.append(
            {
                "stage": i,
                "global_batch": stage.global_batch_size,
                "steps": steps,
                "step_seconds": step_seconds[i],
                "images_per_second": stage.global_batch_size / step_seconds[i],
                "seconds": seconds,
            }
        )
    return rows
