"""Checkpointer: save grid and retention, restore onto mesh shardings, corrupt fallback."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.training.checkpoint import Checkpointer, NoCheckpointError, abstract_like


def _mesh():
    return Mesh(np.asarray(jax.devices()), ("data",))


def _state(mesh, value):
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))
    return {
        "w": jax.device_put(jnp.full((4, 3), value, jnp.float32), replicated),
        "slices": jax.device_put(jnp.arange(16, dtype=jnp.float32) * value, sharded),
        "count": jax.device_put(jnp.asarray(int(value), jnp.int32), replicated),
    }


def _save_steps(directory, mesh, steps, **kwargs):
    ckpt = Checkpointer(directory, **kwargs)
    for step in steps:
        ckpt.save(
            step, _state(mesh, step), {"next_sample": 10 * step}, {"epoch": step / 10}, force=True
        )
    ckpt.wait()
    return ckpt


def test_save_grid_and_keep_last(tmp_path):
    mesh = _mesh()
    ckpt = Checkpointer(tmp_path, every_steps=2, keep=2)
    saved = [
        s for s in range(1, 8) if ckpt.save(s, _state(mesh, s), {"next_sample": s}, {"epoch": 0})
    ]
    ckpt.save(7, _state(mesh, 7), {"next_sample": 7}, {"epoch": 0}, force=True)
    ckpt.close()
    assert saved == [2, 4, 6], f"expected saves on the every_steps=2 grid, got {saved}"
    assert Checkpointer(tmp_path).steps() == [6, 7], "expected the last 2 steps kept"


def test_restore_onto_mesh_shardings(tmp_path):
    mesh = _mesh()
    _save_steps(tmp_path, mesh, [3]).close()
    target = abstract_like(_state(mesh, 0))
    step, state, data, meta = Checkpointer(tmp_path).restore(target)
    assert (step, data, meta) == (3, {"next_sample": 30}, {"epoch": 0.3, "step": 3})
    expected = _state(mesh, 3)
    for key in expected:
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(expected[key]))
        assert state[key].sharding == expected[key].sharding, (
            f"{key}: restored with {state[key].sharding}, expected {expected[key].sharding}"
        )


def _corrupt(step_dir):
    """Overwrite every data file of the step's state item with garbage."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    assert files, f"no files under {step_dir / 'state'}"
    for path in files:
        path.write_bytes(b"\x00garbage" * 3)


def test_corrupt_newest_falls_back_with_warning(tmp_path):
    mesh = _mesh()
    _save_steps(tmp_path, mesh, [1, 2]).close()
    _corrupt(tmp_path / "2")
    with pytest.warns(RuntimeWarning, match="step 2 .* could not be restored"):
        step, state, data, _ = Checkpointer(tmp_path).restore(abstract_like(_state(mesh, 0)))
    assert step == 1, f"expected fallback to step 1, restored step {step}"
    assert data == {"next_sample": 10}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 3), 1.0, np.float32))


def test_all_corrupt_is_an_error(tmp_path):
    mesh = _mesh()
    _save_steps(tmp_path, mesh, [1]).close()
    _corrupt(tmp_path / "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(NoCheckpointError, match="none of the checkpoints"):
            Checkpointer(tmp_path).restore(abstract_like(_state(mesh, 0)))


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(NoCheckpointError, match="no checkpoint"):
        Checkpointer(tmp_path).restore({})
