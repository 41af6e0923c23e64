"""Cut a model's layers into pipeline stages of equal time, from a profile, as PipeDream does.

A stage is a contiguous run of layers. Its time per micro-batch is its layers' forward and
backward time plus what it sends: its output activation to the next stage and the gradient of
its input back to the previous one, each priced by the cost model's link (latency + bytes /
bandwidth). The pipeline runs as fast as its slowest stage, so :func:`partition` chooses the
boundaries that minimise the slowest stage's time, by dynamic programming over (layers, stages):
``best[k][j]``, the least bottleneck of ``j`` layers in ``k`` stages, is the minimum over the
last stage's first layer ``i`` of ``max(best[k-1][i], time(i, j))``. Every contiguous cut is
considered, so the result is optimal (ties go to the earliest boundaries).

A stage's memory is its layers' parameters, gradients, optimizer state and model state, plus
the inputs it stashes for the micro-batches in flight: the schedule's own count
(:meth:`~jaxdist.pipeline.schedules.Schedule.live_activations`, about S − s for stage s under
1F1B, M under GPipe). With a memory limit, cuts whose stage exceeds it are never chosen; when
no cut fits, :class:`PartitionError` names the stage that overflows least and by how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxdist.comm.cost_model import Link
from jaxdist.pipeline import schedules
from jaxdist.pipeline.profile import Profile

__all__ = [
    "Partition",
    "PartitionError",
    "StageCost",
    "message_seconds",
    "partition",
    "stage_costs",
]

GIB = 2**30


class PartitionError(ValueError):
    """No cut satisfies the request; the message says what was asked and what was found."""

    exit_code = 2


@dataclass(frozen=True)
class StageCost:
    """One stage of a cut: layers ``[start, stop)``, its seconds per micro-batch (compute and
    sends) and its bytes."""

    start: int
    stop: int
    forward_s: float
    backward_s: float
    send_s: float
    memory_bytes: int

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.send_s


@dataclass(frozen=True)
class Partition:
    """A cut: the first layer of each stage, each stage's cost, and the pipeline's predicted
    step under ``schedule`` with ``microbatches`` micro-batches."""

    boundaries: tuple[int, ...]
    stages: tuple[StageCost, ...]
    schedule: str
    microbatches: int

    @property
    def slowest_s(self) -> float:
        return max(s.time_s for s in self.stages)

    def step_seconds(self) -> float:
        """The step's time: the schedule's ticks run in lockstep, each as long as its
        slowest op (a forward, or a backward with the stage's sends)."""
        return sum(self._tick_seconds(row) for row in self._table().table)

    def bubble(self) -> float:
        """The idle share of all stage-time in :meth:`step_seconds`."""
        busy = sum(self.microbatches * s.time_s for s in self.stages)
        return 1.0 - busy / (len(self.stages) * self.step_seconds())

    def _table(self) -> schedules.Schedule:
        return schedules.build(self.schedule, len(self.stages), self.microbatches)

    def _tick_seconds(self, row) -> float:
        times = [0.0]
        for stage, op in zip(self.stages, row, strict=True):
            if op is not None:
                times.append(stage.forward_s if op.kind == "F" else stage.backward_s + stage.send_s)
        return max(times)


def message_seconds(link: Link, nbytes: int) -> float:
    """One message of ``nbytes`` to a neighbouring stage: latency plus bytes over bandwidth."""
    return link.alpha + nbytes * link.beta if nbytes else 0.0


def stage_costs(
    profile: Profile,
    boundaries: tuple[int, ...] | list[int],
    link: Link,
    live_inputs: list[int],
) -> tuple[StageCost, ...]:
    """The cost of each stage of the cut at ``boundaries``; ``live_inputs[s]`` is how many
    inputs stage s keeps at once (the schedule's count)."""
    stops = [*boundaries[1:], len(profile.layers)]
    return tuple(
        _stage(profile, start, stop, s, len(stops), link, live_inputs[s])
        for s, (start, stop) in enumerate(zip(boundaries, stops, strict=True))
    )


def _stage(
    profile: Profile, start: int, stop: int, s: int, num_stages: int, link: Link, live: int
) -> StageCost:
    layers = profile.layers[start:stop]
    send = 0.0
    if s < num_stages - 1:  # the output activation goes on
        send += message_seconds(link, layers[-1].activation_bytes)
    input_bytes = profile.layers[start - 1].activation_bytes if start > 0 else 0
    if s > 0:  # the input's gradient goes back
        send += message_seconds(link, input_bytes)
    static = sum(
        2 * x.param_bytes + x.optimizer_bytes + x.model_state_bytes for x in layers
    )  # parameters and their gradients
    return StageCost(
        start,
        stop,
        forward_s=sum(x.forward_s for x in layers),
        backward_s=sum(x.backward_s for x in layers),
        send_s=send,
        memory_bytes=static + live * input_bytes,
    )


def partition(
    profile: Profile,
    stages: int,
    link: Link,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    memory_limit_bytes: float | None = None,
) -> Partition:
    """The cut of ``profile``'s layers into ``stages`` stages with the least slowest-stage
    time, each stage within ``memory_limit_bytes`` (``None``: no limit). ``microbatches``
    (default: ``stages``) sets the schedule's stash counts and the predicted step."""
    n = len(profile.layers)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PartitionError(f"stages must be a positive integer, got {stages!r}")
    if stages > n:
        raise PartitionError(
            f"{stages} stages need at least {stages} layers, but the model has {n}: "
            f"use at most {n} stages"
        )
    microbatches = microbatches or stages
    live = schedules.build(schedule, stages, microbatches).live_activations()

    def cost(i: int, j: int, k: int) -> StageCost:
        return _stage(profile, i, j, k, stages, link, live[k])

    def time_within_limit(i: int, j: int, k: int) -> float:
        c = cost(i, j, k)
        fits = memory_limit_bytes is None or c.memory_bytes <= memory_limit_bytes
        return c.time_s if fits else math.inf

    boundaries = _least_bottleneck(n, stages, time_within_limit)
    if boundaries is None:
        raise PartitionError(_overflow_message(n, stages, cost, memory_limit_bytes))
    return Partition(
        boundaries=tuple(boundaries),
        stages=stage_costs(profile, boundaries, link, live),
        schedule=schedule,
        microbatches=microbatches,
    )


def _least_bottleneck(n: int, stages: int, value) -> list[int] | None:
    """Boundaries of ``n`` layers in ``stages`` stages minimising the largest ``value(i, j, k)``
    of stage k over layers [i, j); ``None`` if every cut has a stage of value ``inf`` (one
    that is not allowed)."""
    inf = math.inf
    # best[k][j]: least bottleneck of the first j layers in k + 1 stages; start[k][j]: the
    # first layer of stage k in it.
    best = [[inf] * (n + 1) for _ in range(stages)]
    start = [[-1] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j], start[0][j] = value(0, j, 0), 0
    for k in range(1, stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                if best[k - 1][i] == inf:
                    continue
                bottleneck = max(best[k - 1][i], value(i, j, k))
                if bottleneck < best[k][j]:
                    best[k][j], start[k][j] = bottleneck, i
    if best[stages - 1][n] == inf:
        return None
    boundaries, j = [], n
    for k in reversed(range(stages)):
        boundaries.append(start[k][j])
        j = start[k][j]
    return boundaries[::-1]


def _overflow_message(n: int, stages: int, cost, limit: float) -> str:
    """Which stage of the cut with the least memory on its fullest stage overflows, by how
    much: the closest any cut comes to the limit."""
    boundaries = _least_bottleneck(n, stages, lambda i, j, k: cost(i, j, k).memory_bytes)
    stops = [*boundaries[1:], n]
    costs = [cost(i, j, k) for k, (i, j) in enumerate(zip(boundaries, stops, strict=True))]
    k, worst = max(enumerate(costs), key=lambda kc: kc[1].memory_bytes)
    return (
        f"no cut of {n} layers into {stages} stages fits in {limit / GIB:.2f} GiB per device: "
        f"the least any cut needs on its fullest stage is {worst.memory_bytes / GIB:.2f} GiB "
        f"(stage {k}, layers {worst.start}-{worst.stop - 1}), "
        f"{(worst.memory_bytes - limit) / GIB:.2f} GiB over"
    )
