"""A schedule's table turned into the integer tables a pipeline program steps through.

The program (:mod:`jaxdist.pipeline.step`) is one SPMD loop over ticks. At tick t the device of
stage s looks up, in arrays of shape ``(ticks, stages)``:

* ``branch``: 0 idle, ``1 + v`` forward of virtual stage v, ``1 + V + v`` its backward;
* ``microbatch``: which micro-batch that op works on;
* ``input_slot``: the slot of the activation stash holding the op's input (virtual stages > 0);
* ``grad_slot``: the slot of the gradient stash holding the output gradient its backward
  pulls back (virtual stages but the last);
* ``receive_input`` / ``receive_grad``: where to store what arrives at the end of the tick
  from the previous stage (an activation) and from the next one (an activation gradient);
* ``weight_slot``: for the PipeDream schedule, the slot of the weight stash that keeps the
  weights a micro-batch's forward used until its backward.

Stash slots are reused: an entry lives from the tick its message arrives to the tick its
backward reads it, and a slot is free again the tick after. With GPipe a stage keeps every
micro-batch's input until the backwards start; with 1F1B at most about S. The slot counts are
what makes the two schedules differ in memory. Slot ``slots`` (one past the last) is a dummy
that receives the messages nobody is waiting for (idle sends).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxdist.pipeline.schedules import Schedule

__all__ = ["Program", "compile_schedule"]


@dataclass(frozen=True)
class Program:
    """Integer tables of one schedule; see the module docstring. Arrays are ``(ticks, stages)``."""

    schedule: Schedule
    branch: np.ndarray
    microbatch: np.ndarray
    input_slot: np.ndarray
    grad_slot: np.ndarray
    receive_input: np.ndarray
    receive_grad: np.ndarray
    weight_slot: np.ndarray
    input_slots: int
    grad_slots: int
    weight_slots: int

    @property
    def virtual_stages(self) -> int:
        return self.schedule.stages * self.schedule.chunks

    @property
    def sends_forward(self) -> np.ndarray:
        """Per tick, whether any stage sends an activation on: only then does the program
        run that tick's forward permute."""
        return (self.receive_input != self.input_slots).any(axis=1)

    @property
    def sends_backward(self) -> np.ndarray:
        """Per tick, whether any stage sends an activation gradient back."""
        return (self.receive_grad != self.grad_slots).any(axis=1)

    @property
    def runs_backward(self) -> np.ndarray:
        """Per tick, whether any stage runs a backward pass (and so, under PipeDream, an
        update)."""
        return (self.branch > self.virtual_stages).any(axis=1)

    @property
    def messages_per_step(self) -> int:
        """Messages each device sends per step: one activation-sized vector in every permute,
        zeros where the device itself has nothing to send that tick."""
        return int(self.sends_forward.sum() + self.sends_backward.sum())


def compile_schedule(schedule: Schedule) -> Program:
    """The :class:`Program` of ``schedule``: op codes and stash slots for every tick and stage."""
    S, V = schedule.stages, schedule.stages * schedule.chunks
    ticks = schedule.ticks
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    for tick, row in enumerate(schedule.table):
        for stage, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.microbatch, op.chunk * S + stage)] = tick

    # Stash entries per stage: (written at, last read at, key). Times are half-ticks: an op
    # runs at 2t, a message lands at 2t + 1, after every op of tick t.
    inputs: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(S)]
    grads: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(S)]
    for (kind, m, v), tick in done.items():
        if kind != "B":
            continue
        if v > 0:
            inputs[v % S].append((2 * done[("F", m, v - 1)] + 1, 2 * tick, (m, v)))
        if v < V - 1:
            grads[v % S].append((2 * done[("B", m, v + 1)] + 1, 2 * tick, (m, v)))
    input_slot_of, input_slots = _allocate(inputs)
    grad_slot_of, grad_slots = _allocate(grads)
    # A weight version lives from its micro-batch's forward to its backward on the same stage.
    weights: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(S)]
    for (kind, m, v), tick in done.items():
        if kind == "B":
            weights[v % S].append((2 * done[("F", m, v)], 2 * tick, (m, v)))
    weight_slot_of, weight_slots = _allocate(weights)

    shape = (ticks, S)
    branch = np.zeros(shape, np.int32)
    microbatch = np.zeros(shape, np.int32)
    input_slot = np.full(shape, input_slots, np.int32)
    grad_slot = np.full(shape, grad_slots, np.int32)
    receive_input = np.full(shape, input_slots, np.int32)
    receive_grad = np.full(shape, grad_slots, np.int32)
    weight_slot = np.full(shape, weight_slots, np.int32)
    for tick, row in enumerate(schedule.table):
        for stage, op in enumerate(row):
            if op is None:
                continue
            v = op.chunk * S + stage
            m = op.microbatch
            microbatch[tick, stage] = m
            branch[tick, stage] = 1 + v if op.kind == "F" else 1 + V + v
            input_slot[tick, stage] = input_slot_of.get((m, v), input_slots)
            weight_slot[tick, stage] = weight_slot_of.get((m, v), weight_slots)
            if op.kind == "B":
                grad_slot[tick, stage] = grad_slot_of.get((m, v), grad_slots)
            # What this op sends lands on a neighbour at the end of the tick.
            if op.kind == "F" and v < V - 1:
                receive_input[tick, (stage + 1) % S] = input_slot_of[(m, v + 1)]
            if op.kind == "B" and v > 0:
                receive_grad[tick, (stage - 1) % S] = grad_slot_of[(m, v - 1)]
    return Program(
        schedule,
        branch,
        microbatch,
        input_slot,
        grad_slot,
        receive_input,
        receive_grad,
        weight_slot,
        input_slots,
        grad_slots,
        weight_slots,
    )


def _allocate(
    entries_per_stage: list[list[tuple[int, int, tuple[int, int]]]],
) -> tuple[dict[tuple[int, int], int], int]:
    """Greedy interval colouring per stage: each entry takes the lowest slot free before it is
    written. Returns the slot of every key and the most slots any stage needs."""
    slot_of: dict[tuple[int, int], int] = {}
    most = 0
    for entries in entries_per_stage:
        free_after: list[int] = []  # per slot, the half-tick of its last read
        for written, last_read, key in sorted(entries):
            slot = next((i for i, t in enumerate(free_after) if t < written), None)
            if slot is None:
                slot = len(free_after)
                free_after.append(last_read)
            else:
                free_after[slot] = last_read
            slot_of[key] = slot
        most = max(most, len(free_after))
    return slot_of, most
