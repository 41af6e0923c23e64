"""The in-flight window that keeps XLA:CPU's queue of collective programs shallow."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

from jaxdist import meshes
from jaxdist.runtime import dispatch
from jaxdist.training import eval_step
from jaxdist.training import train_step as ts
from jaxdist.training.loss_scale import DynamicLossScale
from jaxdist.training.step_options import Communication, Precision, StateSharding
from tests._procs import REPO, clean_env


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_window_keeps_at_most_limit_calls_queued(monkeypatch, limit):
    waited = []
    monkeypatch.setattr(dispatch.jax, "block_until_ready", waited.append)
    window = dispatch.InFlightWindow(limit)
    for call in range(6):
        window.make_room()
        assert len(window) < limit, "room is made before a call is dispatched"
        assert waited == list(range(max(0, call - limit + 1))), "one wait per oldest call"
        window.add(call)
    assert len(window) == limit  # a limit of 1 makes the loop synchronous


def test_no_limit_holds_nothing(monkeypatch):
    monkeypatch.setattr(dispatch.jax, "block_until_ready", pytest.fail)
    window = dispatch.InFlightWindow(None)
    for call in range(100):
        window.make_room()
        window.add(call)
    assert len(window) == 0


def _fake_mesh(platforms):
    devices = [SimpleNamespace(platform=p, id=i) for i, p in enumerate(platforms)]
    return SimpleNamespace(devices=np.array(devices, dtype=object), local_devices=devices)


def test_limits_by_platform_and_bad_values():
    assert dispatch.resolve_limit("auto", meshes.ring(8)) == dispatch.CPU_IN_FLIGHT_LIMIT
    assert dispatch.resolve_limit("auto", meshes.ring(1)) is None  # nothing to rendezvous
    assert dispatch.resolve_limit("auto", _fake_mesh(["gpu"] * 8)) is None
    assert dispatch.resolve_limit("auto", _fake_mesh(["cpu", "gpu"])) is None
    assert dispatch.resolve_limit(None, meshes.ring(8)) is None
    assert dispatch.resolve_limit(7, meshes.ring(8)) == 7
    assert dispatch.resolve_limit(np.int64(3), meshes.ring(8)) == 3
    for bad in (0, -1, True, 2.5, "4", "AUTO"):
        with pytest.raises(ValueError, match=r"max_in_flight must be a positive int, None .*"):
            dispatch.resolve_limit(bad, meshes.ring(8))
    with pytest.raises(ValueError, match=r"limit must be a positive int or None \(no limit\)"):
        dispatch.InFlightWindow("auto")
    with pytest.raises(ValueError, match="max_in_flight"):
        ts.TrainStep(lambda *a: None, optax.sgd(0.1), meshes.ring(8), max_in_flight=0)


def _tiny_loss(params, model_state, batch, rng):
    loss = ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()
    return loss, (model_state, {})


def _tiny_batch(step):
    return step.shard_batch({"x": np.ones((16, 4), np.float32), "y": np.ones((16, 1), np.float32)})


def test_steps_on_the_same_devices_share_one_window():
    mesh = meshes.ring(8)
    first = ts.TrainStep(_tiny_loss, optax.sgd(0.01), mesh, communication=Communication("ring"))
    second = ts.TrainStep(
        _tiny_loss, optax.sgd(0.02), meshes.ring(8), communication=Communication("ring")
    )
    evaluate = eval_step.EvalStep(lambda p, ms, b: {"n": b["x"].shape[0]}, mesh)
    assert first._in_flight is second._in_flight is evaluate._in_flight
    other = ts.TrainStep(_tiny_loss, optax.sgd(0.01), mesh, max_in_flight=2)
    assert other._in_flight is not first._in_flight and other._in_flight.limit == 2

    state = first.init({"w": np.zeros((4, 1), np.float32)})
    batch = _tiny_batch(first)
    for _ in range(6):
        state, _ = first(state, batch, jax.random.key(0))
        sums = evaluate(state, batch)
        state, _ = second(state, batch, jax.random.key(1))
    assert len(first._in_flight) <= dispatch.CPU_IN_FLIGHT_LIMIT
    assert int(sums["n"]) == 16


@pytest.mark.parametrize("variant", ["donated", "donated_loss_scale", "donated_zero1"])
def test_waiting_on_earlier_steps_works_with_donated_state(variant):
    """The window waits on metrics. With two calls queued it waits for the call before last,
    whose state was donated to the last call: waiting on that state would fail ("called on
    deleted or donated buffer")."""
    options = {
        "donated": {},
        "donated_loss_scale": {
            "precision": Precision(loss_scale=DynamicLossScale.create(initial_scale=2.0**8))
        },
        "donated_zero1": {"sharding": StateSharding("zero1")},
    }[variant]
    step = ts.TrainStep(
        _tiny_loss, optax.sgd(0.01), meshes.ring(8), donate=True, max_in_flight=2, **options
    )
    state = step.init({"w": np.zeros((4, 1), np.float32)})
    batch = _tiny_batch(step)
    for _ in range(4):
        state, metrics = step(state, batch, jax.random.key(0))
    assert int(state.step) == 4 and np.isfinite(float(metrics["loss"]))


@pytest.mark.multiprocess
def test_many_unblocked_steps_finish_on_eight_cpu_devices():
    """Without the window this loop hung XLA:CPU (ring allreduce, 8 devices; see
    benchmarks/queue_depth.py); the collective timeouts are cut so that a hang fails the test
    in seconds. The loop also counts the window's waits, so a window that stopped limiting
    fails here even on a runtime that no longer hangs."""
    script = textwrap.dedent(
        """
        import jax, numpy as np, optax
        from jaxdist import meshes
        from jaxdist.runtime import dispatch
        from jaxdist.training import train_step as ts
        from jaxdist.training.step_options import Communication
        from tests.test_dispatch import _tiny_loss
        waits = []
        wait = dispatch.jax.block_until_ready
        dispatch.jax.block_until_ready = lambda x: (waits.append(1), wait(x))[1]
        step = ts.TrainStep(
            _tiny_loss,
            optax.sgd(0.01),
            meshes.build("torus-4x2"),
            communication=Communication("ring"),
        )
        assert step._in_flight.limit == dispatch.CPU_IN_FLIGHT_LIMIT, step._in_flight.limit
        state = step.init({"w": np.zeros((4, 1), np.float32)})
        batch = {"x": np.ones((16, 4), np.float32), "y": np.ones((16, 1), np.float32)}
        rng = jax.random.key(0)
        for _ in range(1500):
            state, metrics = step(state, step.shard_batch(batch), rng)
        print("steps", int(state.step), "waits", len(waits), flush=True)
        """
    )
    flags = (
        "--xla_force_host_platform_device_count=8"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=5"
        " --xla_cpu_collective_call_terminate_timeout_seconds=15"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=clean_env(XLA_FLAGS=flags),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    limit = dispatch.CPU_IN_FLIGHT_LIMIT
    expected = f"steps 1500 waits {1500 - limit}"
    assert proc.returncode == 0 and expected in proc.stdout, output[-3000:]
