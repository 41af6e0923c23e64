"""The in-flight window that keeps XLA:CPU's queue of collective programs shallow."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from jaxdist import dispatch, meshes
from jaxdist import train_step as ts
from tests._procs import REPO, clean_env


def test_window_waits_for_the_oldest_beyond_its_limit(monkeypatch):
    waited = []
    monkeypatch.setattr(dispatch.jax, "block_until_ready", waited.append)
    window = dispatch.InFlightWindow(2)
    for call in range(5):
        window.admit(call)
        assert len(window) == min(call + 1, 2)
    assert waited == [0, 1, 2], "expected a wait on each oldest call once more than 2 were held"


def test_no_limit_holds_nothing(monkeypatch):
    monkeypatch.setattr(dispatch.jax, "block_until_ready", pytest.fail)
    window = dispatch.InFlightWindow(None)
    for call in range(100):
        window.admit(call)
    assert len(window) == 0


def test_limits_by_platform_and_bad_values():
    assert dispatch.resolve_limit("auto", meshes.ring(8)) == dispatch.CPU_IN_FLIGHT_LIMIT
    assert dispatch.resolve_limit("auto", meshes.ring(1)) is None  # nothing to rendezvous
    assert dispatch.resolve_limit(None, meshes.ring(8)) is None
    assert dispatch.resolve_limit(7, meshes.ring(8)) == 7
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match=r"max_in_flight must be a positive int, None .*"):
            dispatch.resolve_limit(bad, meshes.ring(8))
    with pytest.raises(ValueError, match="max_in_flight"):
        ts.TrainStep(lambda *a: None, optax.sgd(0.1), meshes.ring(8), max_in_flight=0)


def _tiny_loss(params, model_state, batch, rng):
    loss = ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()
    return loss, (model_state, {})


def test_train_and_eval_steps_hold_at_most_their_limit():
    mesh = meshes.ring(8)
    step = ts.TrainStep(_tiny_loss, optax.sgd(0.01), mesh, allreduce="ring", max_in_flight=3)
    evaluate = ts.EvalStep(lambda p, ms, b: {"n": b["x"].shape[0]}, mesh, max_in_flight=2)
    state = step.init({"w": np.zeros((4, 1), np.float32)})
    batch = step.shard_batch({"x": np.ones((16, 4), np.float32), "y": np.ones((16, 1), np.float32)})
    for _ in range(6):
        state, _ = step(state, batch, jax.random.key(0))
        sums = evaluate(state, batch)
    assert len(step._in_flight) == 3 and len(evaluate._in_flight) == 2
    assert int(sums["n"]) == 16


@pytest.mark.multiprocess
def test_many_unblocked_steps_finish_on_eight_cpu_devices():
    """Without the window this loop hung XLA:CPU within 500 steps (ring allreduce, 8 devices);
    the collective timeouts are cut so that a hang fails the test in seconds, not minutes."""
    script = textwrap.dedent(
        """
        import jax, numpy as np, optax
        from jaxdist import meshes, train_step as ts
        from tests.test_dispatch import _tiny_loss
        step = ts.TrainStep(_tiny_loss, optax.sgd(0.01), meshes.build("torus-4x2"), allreduce="ring")
        state = step.init({"w": np.zeros((4, 1), np.float32)})
        batch = {"x": np.ones((16, 4), np.float32), "y": np.ones((16, 1), np.float32)}
        rng = jax.random.key(0)
        for _ in range(1500):
            state, metrics = step(state, step.shard_batch(batch), rng)
        print("steps", int(state.step), flush=True)
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
    assert proc.returncode == 0 and "steps 1500" in proc.stdout, output[-3000:]
