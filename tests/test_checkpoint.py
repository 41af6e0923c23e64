"""Checkpointer: save grid and retention, restore onto mesh shardings, corrupt fallback that
moves the unreadable steps aside, and one quiet line when none can be read."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.run.checkpoint import (
    Checkpointer,
    CheckpointWarning,
    NoCheckpointError,
    abstract_like,
)
from tests._procs import clean_env

TESTS = Path(__file__).resolve().parent


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


def test_one_process_writes_each_array_once_without_compiling_per_array(tmp_path):
    """In one process every copy of a replicated array is local, so one device writes it:
    orbax's replica-parallel writing would compile a slicing program per array. The one
    program a save compiles is the digest of the whole state."""
    replicated = NamedSharding(_mesh(), P())
    state = {  # shapes of this test's own, so that no earlier test compiled their slices
        "w": jax.device_put(jnp.ones((88, 3), jnp.float32), replicated),
        "v": jax.device_put(jnp.ones((40, 7), jnp.float32), replicated),
    }
    lowered = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        ckpt = Checkpointer(tmp_path)
        ckpt.save(1, state, {"next_sample": 0}, {"epoch": 0}, force=True)
        ckpt.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == ["jit(checkpoint_digests)"], f"the save compiled {lowered}"
    _, restored, _, _ = Checkpointer(tmp_path).restore(abstract_like(state))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((88, 3)))


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


def _corrupt(step_dir, arrays_only=False):
    """Overwrite the files of the step's state item with garbage; ``arrays_only``: only the
    array store (OCDBT manifests and data), which TensorStore reads."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    if arrays_only:
        files = [p for p in files if p.name == "manifest.ocdbt" or p.parent.name == "d"]
    assert files, f"no files under {step_dir / 'state'}"
    for path in files:
        path.write_bytes(b"\x00garbage" * 3)


def test_corrupt_newest_falls_back_with_warning_and_is_moved_aside(tmp_path):
    mesh = _mesh()
    directory = tmp_path / "checkpoints"
    _save_steps(directory, mesh, [1, 2]).close()
    _corrupt(directory / "2")
    ckpt = Checkpointer(directory)
    with pytest.warns(CheckpointWarning) as caught:
        step, state, data, _ = ckpt.restore(abstract_like(_state(mesh, 0)))
    assert step == 1, f"expected fallback to step 1, restored step {step}"
    assert data == {"next_sample": 10}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 3), 1.0, np.float32))
    messages = [str(w.message) for w in caught]
    assert re.search(r"step 2 .* cannot be read \(\w+Error: .{1,160}\)$", messages[0])
    assert all("\n" not in m for m in messages), messages
    # The unreadable step leaves the checkpoints, so the run saves it anew.
    assert ckpt.steps() == [1] and (tmp_path / "checkpoints.unreadable" / "2").is_dir()
    assert "moved the unreadable step 2" in messages[1]
    assert ckpt.save(2, _state(mesh, 2), {"next_sample": 20}, {"epoch": 0.2}, force=True)
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    assert ckpt.restore(abstract_like(_state(mesh, 0)))[0] == 2


ALL_UNREADABLE = """
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(sys.argv[2])))
warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\\n"
from test_checkpoint import _corrupt, _mesh
from jaxdist.run.checkpoint import Checkpointer, NoCheckpointError, abstract_like

# Many arrays: enough reads in flight that TensorStore and asyncio report the failed reads,
# during the restore and when the process exits, unless the Checkpointer hides them.
replicated = NamedSharding(_mesh(), P())
def state(value):
    return {f"leaf{i}": jax.device_put(jnp.full((8,), value + i), replicated) for i in range(50)}

directory = Path(sys.argv[1])
ckpt = Checkpointer(directory)
for step in (1, 2):
    ckpt.save(step, state(step), {"next_sample": step}, {}, force=True)
ckpt.close()
for step in (1, 2):
    _corrupt(directory / str(step), arrays_only=True)
try:
    Checkpointer(directory).restore(abstract_like(state(0)))
except NoCheckpointError as err:
    print(f"NoCheckpointError: {err}", file=sys.stderr)
"""


def test_all_unreadable_is_one_line_quietly_and_leaves_them_untouched(tmp_path):
    script = tmp_path / "all_unreadable.py"
    script.write_text(ALL_UNREADABLE)
    directory = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, str(script), str(directory), str(TESTS)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 3, (
        f"expected two warnings and the error, each on one line; got {len(lines)} lines:\n"
        f"{proc.stderr[:3000]}"
    )
    assert all("CheckpointWarning: checkpoint at step" in line for line in lines[:2]), lines
    error = lines[2]
    assert len(error) < 800, error
    assert re.search(r"none of the 2 checkpoints .* \(step 2: \w+Error: .*; step 1: ", error)
    assert "move that folder aside" in error
    # Left untouched: both steps still there, nothing moved aside.
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert not (tmp_path / "checkpoints.unreadable").exists()


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(NoCheckpointError, match="no checkpoint"):
        Checkpointer(tmp_path).restore({})


def _rewrite_arrays(step_dir, change):
    """Step ``step_dir``'s arrays written again with ``change`` applied, as a bad copy or disk
    would leave them: the files decode, the values are not the ones saved."""
    import shutil

    import orbax.checkpoint as ocp
    from etils import epath

    path = epath.Path(step_dir / "state")
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(path).item_metadata
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), saved
        )
        tree = change(dict(checkpointer.restore(path, target)))
    shutil.rmtree(path)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)


def test_changed_bytes_are_found_by_their_digest_and_the_previous_step_restored(tmp_path):
    """Step 2's arrays rewritten with one value changed: the restore names the array, moves
    the step aside and resumes from step 1. Without digests (an older checkpoint), a value
    that is not finite is found the same way."""
    import json

    mesh = _mesh()
    directory = tmp_path / "checkpoints"
    _save_steps(directory, mesh, [1, 2]).close()
    _rewrite_arrays(directory / "2", lambda t: {**t, "w": t["w"].at[0, 0].set(2.5)})
    ckpt = Checkpointer(directory)
    with pytest.warns(CheckpointWarning) as caught:
        step, state, _, _ = ckpt.restore(abstract_like(_state(mesh, 0)))
    assert step == 1 and float(state["w"][0, 0]) == 1.0
    assert "array w does not match the digest saved with it" in str(caught[0].message)
    assert (tmp_path / "checkpoints.unreadable" / "2").is_dir()

    ckpt.save(2, _state(mesh, 2), {"next_sample": 20}, {"epoch": 0.2}, force=True)
    ckpt.close()
    meta = directory / "2" / "meta" / "metadata"
    meta.write_text(
        json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "digests"})
    )
    _rewrite_arrays(directory / "2", lambda t: {**t, "slices": t["slices"].at[3].set(jnp.nan)})
    with pytest.warns(CheckpointWarning) as caught:
        step, _, _, _ = Checkpointer(directory).restore(abstract_like(_state(mesh, 0)))
    assert step == 1
    assert "array slices holds non-finite values" in str(caught[0].message)
