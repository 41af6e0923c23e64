"""Wait-free backprop as the compiler must see it: every gradient bucket's schedule advances
one message step beside each matrix product of the rest of the backward pass.

Poseidon's wait-free backprop starts each layer's synchronisation as soon as its gradient
exists and runs it while backward computes the earlier layers. Writing the buckets' allreduces
after ``jax.grad`` leaves the *order* to XLA's scheduler, and a ring is a chain: each step
needs the one before it, so the scheduler runs the chains one step after another once
backward is done, and at most their first steps overlap anything. This module fixes the
order in the program itself:

1. The loss's gradient is traced once (``jax.make_jaxpr`` of ``jax.grad``) and then run
   segment by segment (:func:`jax.core.eval_jaxpr` on each segment, so every op keeps its
   name and place in the model). A segment ends after each matrix product or convolution.
2. Once every gradient of a bucket has been computed, the bucket's allreduce starts: its
   schedule (any of :mod:`jaxdist.comm.collectives`, unchanged) runs as a coroutine (a
   greenlet) until its first message step, which it sends and then hands back.
3. Before the next matrix product, every bucket in flight gets its message back tied, by one
   ``lax.optimization_barrier``, to an input of that product which is in memory anyway (its
   kernel, or a cotangent an earlier product of backward read): the message cannot be
   waited for before that point, and the product cannot run before the message is there.
   So each step is done by the product it is tied to, and the schedule goes on to its next
   step. The tie bounds when a step ends, not when the next may start: a kernel is in memory
   from the forward pass on, so the compiler may run two or three steps of a bucket between
   the same two products when their messages are there early. Tying a value only backward
   computes would pin both ends, but keeps it from fusing into its consumers, which costs
   more memory traffic than the communication it hides (benchmarks/results/NOTES_wait_free.md). The steps still pending when backward ends run as they come, bucket
   after bucket in turn.

The arithmetic is that of ``jax.grad`` followed by the same schedules, op for op: only the
order the compiler may pick is narrowed. Nothing tied would otherwise have been fused away;
what it costs is every schedule step unrolled, and a longer compile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import greenlet
import jax
from jax import lax
from jax.extend import core as jex

from jaxdist.comm.collectives.wire import paced_sends

__all__ = ["wait_free_gradients"]

# Primitives whose cost dominates a backward segment: a segment ends after each of them.
_MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")


def wait_free_gradients(
    objective: Callable[[Any], tuple[jax.Array, Any]],
    params: Any,
    buckets: Sequence[Sequence[int]],
    reduce_bucket: Callable[[int, list[jax.Array]], list[jax.Array]],
    scope: str | None = None,
) -> tuple[Any, Any]:
    """``(reduced gradients, aux)`` of ``objective(params) -> (value, aux)``, every bucket of
    gradient leaves (indices into ``params``' leaves) reduced by ``reduce_bucket(b, leaves)
    -> reduced leaves`` while backward still computes; see the module docstring. Leaves in no
    bucket are returned as computed. The allreduces' ops are made inside
    ``jax.named_scope(scope)``. Call inside shard_map."""
    leaves, treedef = jax.tree.flatten(params)
    num_leaves = len(leaves)

    def gradient(*flat):
        return jax.grad(
            lambda *ls: objective(treedef.unflatten(ls)),
            argnums=tuple(range(num_leaves)),
            has_aux=True,
        )(*flat)

    closed, out_shapes = jax.make_jaxpr(gradient, return_shape=True)(*leaves)
    run = _SegmentedRun(closed, leaves, num_params=num_leaves)
    grad_vars = closed.jaxpr.outvars[:num_leaves]
    ready_at = [max((run.defined_at(grad_vars[k]) for k in b), default=-1) for b in buckets]
    pending = sorted(range(len(buckets)), key=ready_at.__getitem__)
    flights: list[_Flight] = []

    def launch(b: int) -> None:
        flight = _Flight(b, scope)
        flights.append(flight)
        flight.resume(lambda: reduce_bucket(b, [run.read(grad_vars[k]) for k in buckets[b]]))

    with paced_sends(_pause_at_send):
        while not run.finished:
            while pending and ready_at[pending[0]] < run.position:
                launch(pending.pop(0))
            in_flight = [f for f in flights if f.waiting]
            if in_flight:
                run.until_matmul()
                tie = run.tie_for_next_matmul()
                while tie is None and not run.finished:  # a segment to the next product to tie
                    run.until_matmul()
                    tie = run.tie_for_next_matmul()
                tied = [] if tie is None else [tie]
                messages, values = lax.optimization_barrier(
                    ([f.message for f in in_flight], [run.read(v) for v in tied])
                )
                run.replace(dict(zip(tied, values)))
                for flight, message in zip(in_flight, messages):
                    flight.resume(message)
            else:
                run.until(ready_at[pending[0]] + 1 if pending else run.num_eqns)
        for b in pending:  # gradients the program returns without computing them
            launch(b)
        while any(f.waiting for f in flights):  # the steps left once backward is done
            for flight in flights:
                if flight.waiting:
                    flight.resume(flight.message)
    outputs = run.outputs()
    reduced = list(outputs[:num_leaves])
    for flight in flights:
        for k, leaf in zip(buckets[flight.bucket], flight.result):
            reduced[k] = leaf
    aux = jax.tree.unflatten(jax.tree.structure(out_shapes[1]), outputs[num_leaves:])
    return treedef.unflatten(reduced), aux


class _Coroutine(greenlet.greenlet):
    """A bucket's allreduce, paused at each message step."""


def _pause_at_send(send_step: Callable[[], jax.Array]) -> jax.Array:
    """A schedule's message step: sent, then (inside a bucket's coroutine) handed to the
    driving loop, which resumes the schedule with the message tied to backward compute."""
    message = send_step()
    current = greenlet.getcurrent()
    if not isinstance(current, _Coroutine):
        return message
    return current.parent.switch(_Sent(message))


@dataclass
class _Sent:
    message: jax.Array


@dataclass
class _Flight:
    """One bucket's allreduce running as a coroutine."""

    bucket: int
    scope: str | None
    coroutine: _Coroutine | None = None
    message: jax.Array | None = None
    result: list[jax.Array] = field(default_factory=list)

    @property
    def waiting(self) -> bool:
        return self.message is not None

    def resume(self, value: Any) -> None:
        """Start the schedule (``value``: the function to run) or go on from its last step
        (``value``: the message, tied), until its next step or its end. The scope is entered
        here, on the driving side: a scope entered inside the coroutine and left open across
        a pause would name the backward ops traced meanwhile."""
        with jax.named_scope(self.scope) if self.scope else contextlib.nullcontext():
            if self.coroutine is None:
                self.coroutine = _Coroutine(value)
                out = self.coroutine.switch()
            else:
                out = self.coroutine.switch(value)
        if isinstance(out, _Sent):
            self.message = out.message
        else:
            self.message, self.result = None, list(out)


class _SegmentedRun:
    """A closed jaxpr run a segment at a time, keeping the values later segments read."""

    def __init__(self, closed: jex.ClosedJaxpr, args: Sequence[Any], num_params: int):
        self.jaxpr = closed.jaxpr
        self.eqns = list(self.jaxpr.eqns)
        self.num_eqns = len(self.eqns)
        self.position = 0
        self.env: dict[Any, Any] = dict(zip(self.jaxpr.constvars, closed.consts))
        self.env.update(zip(self.jaxpr.invars, args))
        self._defined = {v: i for i, eqn in enumerate(self.eqns) for v in eqn.outvars}
        self._last_use: dict[Any, int] = {}
        for i, eqn in enumerate(self.eqns):
            for v in eqn.invars:
                if isinstance(v, jex.Var):
                    self._last_use[v] = i
        for v in self.jaxpr.outvars:
            if isinstance(v, jex.Var):
                self._last_use[v] = self.num_eqns
        self._matmul = [has_matmul(eqn) for eqn in self.eqns]
        self._read_by_paced_matmul: set[Any] = set()
        # Values computed from the first ``num_params`` inputs (the parameters) alone.
        self._from_params = set(self.jaxpr.invars[:num_params])
        for eqn in self.eqns:
            reads = [v for v in eqn.invars if isinstance(v, jex.Var)]
            if reads and all(v in self._from_params for v in reads):
                self._from_params.update(eqn.outvars)

    @property
    def finished(self) -> bool:
        return self.position >= self.num_eqns

    def defined_at(self, var: Any) -> int:
        """Index of the equation that computes ``var`` (-1: an input, constant or literal)."""
        return self._defined.get(var, -1) if isinstance(var, jex.Var) else -1

    def read(self, var: Any) -> Any:
        return var.val if isinstance(var, jex.Literal) else self.env[var]

    def until_matmul(self) -> None:
        """Run up to and including the next matrix product (or to the end), a segment of the
        paced backward pass."""
        stop = self.position
        while stop < self.num_eqns and not self._matmul[stop]:
            stop += 1
        if stop < self.num_eqns:
            self._read_by_paced_matmul.update(
                v for v in self.eqns[stop].invars if isinstance(v, jex.Var)
            )
        self.until(min(stop + 1, self.num_eqns))

    def tie_for_next_matmul(self) -> Any | None:
        """A value the next matrix product reads that is in memory whatever the program
        does: one computed from the parameters alone (a kernel, or its cast to the compute
        dtype), or one an earlier product of the paced backward pass read already (a
        cotangent that feeds both a layer's input-gradient and kernel-gradient products).
        None if it reads no such value.

        Tying a message to it makes the product wait for the message at no cost. Tying a
        value only elementwise ops have read would keep it from fusing into them, and tying
        a saved activation would make the forward pass keep it in the tied form: both add
        memory traffic to the step."""
        stop = self.position
        while stop < self.num_eqns and not self._matmul[stop]:
            stop += 1
        if stop == self.num_eqns:
            return None
        inputs = [v for v in self.eqns[stop].invars if isinstance(v, jex.Var) and v in self.env]
        free = [v for v in inputs if v in self._from_params] or [
            v for v in inputs if v in self._read_by_paced_matmul
        ]
        return free[0] if free else None

    def until(self, stop: int) -> dict[Any, Any]:
        """Run equations ``[position, stop)``; returns the values they computed that later
        equations (or the outputs) read."""
        eqns = self.eqns[self.position : stop]
        if not eqns:
            return {}
        defined = dict.fromkeys(v for eqn in eqns for v in eqn.outvars)
        reads = [v for eqn in eqns for v in eqn.invars if isinstance(v, jex.Var)]
        inputs = list(dict.fromkeys(v for v in reads if v not in defined))
        live = [v for v in defined if self._last_use.get(v, -1) >= stop]
        effects = frozenset().union(*(eqn.effects for eqn in eqns))
        names = jex.DebugInfo(
            "wait-free backward segment",
            "jaxdist.training.wait_free",
            tuple(map(str, inputs)),
            tuple(map(str, live)),
        )
        segment = jex.Jaxpr([], inputs, live, eqns, effects, names)
        values = jax.core.eval_jaxpr(segment, [], *(self.env[v] for v in inputs))
        self.position = stop
        produced = dict(zip(live, values))
        self.env.update(produced)
        for v in inputs:  # free what no later equation reads
            if self._last_use.get(v, -1) < stop:
                del self.env[v]
        return produced

    def replace(self, values: dict[Any, Any]) -> None:
        self.env.update(values)

    def outputs(self) -> list[Any]:
        return [self.read(v) for v in self.jaxpr.outvars]


def has_matmul(eqn: Any) -> bool:
    """Whether an equation is, or calls a computation holding, a matrix product."""
    if eqn.primitive.name in _MATMUL_PRIMITIVES:
        return True
    return any(
        has_matmul(inner)
        for sub in jex.jaxprs_in_params(eqn.params)
        for inner in getattr(sub, "eqns", getattr(getattr(sub, "jaxpr", None), "eqns", []))
    )
