"""Timing helpers shared by the benchmarks (jaxdist.bench.timing)."""

import pytest

from jaxdist.bench import timing


def test_interleaved_rounds_alternate_the_order():
    calls = []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    seconds = timing.interleaved_rounds(runners, steps=2, rounds=3)
    rounds = [calls[i : i + 6] for i in range(0, 18, 6)]
    assert rounds[0] == ["a", "a", "b", "b", "c", "c"]
    assert rounds[1] == ["c", "c", "b", "b", "a", "a"]  # reversed: nobody always runs first
    assert rounds[2] == rounds[0]
    assert {name: len(times) for name, times in seconds.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved_rounds(runners, steps=1, rounds=0)


def test_warm_up_runs_each_runner_once_plus_warmup():
    calls, compiled = [], []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    seconds = timing.warm_up(runners, warmup=2, on_compiled=lambda n, s: compiled.append(n))
    assert calls == ["a", "a", "a", "b", "b", "b"]
    assert compiled == ["a", "b"] and set(seconds) == {"a", "b"}
    assert all(s >= 0 for s in seconds.values())
