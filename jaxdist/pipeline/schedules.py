"""Pipeline schedules as data: which stage runs which micro-batch's forward or backward pass
at each tick.

A model cut into S stages runs on S devices; a batch is cut into M micro-batches that flow
through them. A schedule is a table, ``table[tick][stage]``, holding an :class:`Op` (forward
or backward of micro-batch m on one of the device's model chunks) or ``None`` (idle). The same
table drives the pictures here and is what a pipeline program steps through.

* **GPipe**: every forward, then every backward, then one update. Stage 0 keeps all M
  micro-batches' activations until their backward passes.
* **1F1B** (PipeDream-Flush): stage s runs S − s − 1 forwards to warm up, then alternates one
  forward and one backward, then drains the backwards. At most S − s micro-batches' activations
  are alive on stage s.
* **PipeDream** and **PipeDream-2BW**: 1F1B's table, but each stage updates its weights
  after every backward (PipeDream, with the weights each micro-batch's forward used stashed
  for its backward) or once per step from gradients of the weights one step older
  (2BW, two versions); see :mod:`jaxdist.pipeline.asynchronous`.
* **Interleaved 1F1B** (Megatron-LM): each device holds v model chunks (virtual stages
  s, s + S, ..., s + (v − 1)S), so the pipeline is v·S stages deep while each op is 1/v as
  long; the bubble shrinks to (S − 1)/(v·M + S − 1). M must be a multiple of S.

Every op takes one tick (a chunk's forward or backward pass) and a result reaches the next
stage in time for the next tick. With ops of equal length the bubble, the idle share of all
stage-ticks, is (S − 1)/(M + S − 1) for GPipe and 1F1B: they differ in memory, not in time.
Tables are built by :func:`build` from each device's order of ops, each op placed at the first
tick where its input exists.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ASYNCHRONOUS",
    "SCHEDULES",
    "Op",
    "Schedule",
    "build",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "pipedream", "pipedream_2bw")
# Schedules whose stages update without a flush, on weights older than the newest
# (:mod:`jaxdist.pipeline.asynchronous`); their tables are 1F1B's.
ASYNCHRONOUS = ("pipedream", "pipedream_2bw")


@dataclass(frozen=True)
class Op:
    """One tick's work on one device: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of
    micro-batch ``microbatch`` on the device's model chunk ``chunk`` (0 unless interleaved)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule's table, ``table[tick][stage]``: an :class:`Op` or ``None``."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    table: tuple[tuple[Op | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of all stage-ticks."""
        idle = sum(op is None for row in self.table for op in row)
        return idle / (self.ticks * self.stages)

    def live_activations(self) -> list[int]:
        """Per stage, the most micro-batch chunks whose forward has run and backward not yet:
        the activations the stage must keep at once."""
        peaks = []
        for stage in range(self.stages):
            alive = peak = 0
            for row in self.table:
                op = row[stage]
                if op is not None:
                    alive += 1 if op.kind == "F" else -1
                    peak = max(peak, alive)
            peaks.append(peak)
        return peaks

    def text(self) -> str:
        """The table as text: a row per stage, a column per tick, ``.`` for idle."""
        width = max(len(str(op)) for row in self.table for op in row if op is not None)
        lines = []
        for stage in range(self.stages):
            cells = [str(row[stage]) if row[stage] else "." for row in self.table]
            lines.append(f"stage {stage}: " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(lines)


def bubble_formula(name: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The bubble the papers give: (S − 1)/(v·M + S − 1), with v = 1 but for interleaved."""
    v = chunks if name == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


def orders(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Op]]:
    """Each device's ops in the order it runs them."""
    _check(name, stages, microbatches, chunks)
    S, M = stages, microbatches
    if name == "gpipe":
        return [[Op("F", m) for m in range(M)] + [Op("B", m) for m in range(M)] for _ in range(S)]
    if name == "1f1b" or name in ASYNCHRONOUS:
        return [
            _one_forward_one_backward(
                S - s - 1, [Op("F", m) for m in range(M)], [Op("B", m) for m in range(M)]
            )
            for s in range(S)
        ]
    # Interleaved: micro-batches in groups of S run through chunk 0, then chunk 1, ...;
    # backwards visit the chunks in reverse. Warm-up covers the deeper pipeline.
    forwards = [Op("F", g + i, c) for g in range(0, M, S) for c in range(chunks) for i in range(S)]
    backwards = [
        Op("B", g + i, c) for g in range(0, M, S) for c in reversed(range(chunks)) for i in range(S)
    ]
    return [
        _one_forward_one_backward(
            min(2 * (S - s - 1) + (chunks - 1) * S, M * chunks), forwards, backwards
        )
        for s in range(S)
    ]


def _one_forward_one_backward(warmup: int, forwards: list[Op], backwards: list[Op]) -> list[Op]:
    """``warmup`` forwards, then one forward and one backward in turn, then the backwards."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    rest = forwards[warmup:]
    for i, backward in enumerate(backwards):
        if i < len(rest):
            order.append(rest[i])
        order.append(backward)
    return order


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The table of schedule ``name`` (one of :data:`SCHEDULES`): each device's ops in its
    :func:`orders` order, each at the first tick after its input was made (the previous
    virtual stage's forward; the next one's backward, or the same op's forward on the last)."""
    chunks = chunks if name == "interleaved" else 1
    S = stages
    queues = orders(name, stages, microbatches, chunks)
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    last_virtual = S * chunks - 1
    rows: list[tuple[Op | None, ...]] = []
    positions = [0] * S
    while any(p < len(q) for p, q in zip(positions, queues, strict=True)):
        tick = len(rows)
        row: list[Op | None] = []
        for stage in range(S):
            op = queues[stage][positions[stage]] if positions[stage] < len(queues[stage]) else None
            if op is not None and _ready(op, op.chunk * S + stage, last_virtual, done, tick):
                positions[stage] += 1
            else:
                op = None
            row.append(op)
        for stage, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.microbatch, op.chunk * S + stage)] = tick
        rows.append(tuple(row))
        if tick > 4 * (microbatches * chunks + S) * 2:
            raise RuntimeError(f"schedule {name!r} deadlocked: its orders cannot all run")
    return Schedule(name, stages, microbatches, chunks, tuple(rows))


def _ready(op: Op, virtual: int, last_virtual: int, done: dict, tick: int) -> bool:
    if op.kind == "F":
        needed = None if virtual == 0 else ("F", op.microbatch, virtual - 1)
    elif virtual == last_virtual:
        needed = ("F", op.microbatch, virtual)
    else:
        needed = ("B", op.microbatch, virtual + 1)
    return needed is None or done.get(needed, tick) < tick


def _check(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {name!r}")
    for label, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name == "interleaved" and microbatches % stages:
        raise ValueError(
            f"the interleaved schedule runs micro-batches in groups of the stage count: "
            f"microbatches ({microbatches}) must be a multiple of stages ({stages})"
        )
