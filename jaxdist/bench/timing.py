"""Timing several variants fairly on a shared, noisy machine.

Benchmarks that compare variants (a jaxdist step against a hand-written one, one allreduce
against another) time them in *interleaved rounds*: every variant runs ``steps`` steps, then
the next variant, and so on, ``rounds`` times; a variant's time is the median over rounds. Load
from other processes then hits every variant alike. The order is reversed every other round
(A B, B A, A B, ...) so that no variant always runs first -- right after compilation, garbage
collection of the previous round's buffers, or another variant's cache footprint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["interleaved_rounds", "warm_up"]


def warm_up(
    runners: dict[str, Callable[[], Any]],
    warmup: int,
    on_compiled: Callable[[str, float], None] | None = None,
) -> dict[str, float]:
    """Run every runner once (compiling it) and then ``warmup`` more times, untimed.

    Returns each runner's first-call seconds (its compile time, near enough); calls
    ``on_compiled(name, seconds)`` after each runner's first call when given.
    """
    compile_seconds = {}
    for name, runner in runners.items():
        start = time.perf_counter()
        jax.block_until_ready(runner())
        compile_seconds[name] = time.perf_counter() - start
        if on_compiled is not None:
            on_compiled(name, compile_seconds[name])
        for _ in range(warmup):
            jax.block_until_ready(runner())
    return compile_seconds


def interleaved_rounds(
    runners: dict[str, Callable[[], Any]], steps: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per step of each runner in each round (see the module docstring).

    Each runner performs one step and returns something to block on (or ``None``). The steps
    of a round are dispatched back to back and waited for once at its end, as a training loop
    would run them; a runner that blocks inside itself is timed the same way.
    """
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got steps={steps}, rounds={rounds}")
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            for _ in range(steps):
                out = runners[name]()
            jax.block_until_ready(out)
            seconds[name].append((time.perf_counter() - start) / steps)
    return seconds
