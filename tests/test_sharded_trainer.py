"""The trainer with a sharded state: a ResNet recipe under FSDP equals the replicated run, and
a checkpoint written under one sharding and device count resumes under another."""

import jax
import numpy as np
import pytest

from jaxdist.run.trainer import Trainer
from tests.test_trainer import Crash, _crash_at, tiny_config


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip


# One batch size throughout (no ramp): each run compiles one train step. ResNet-18: over the
# four steps after the resume, float32 rounding (8 devices against 4) stays under the bound
# below, where ResNet-10's steps grow it to 1.5e-4.
ONE_BATCH = {"batch_ramp": (), "model.name": "resnet18"}


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory):
    trainer = Trainer(tiny_config(**ONE_BATCH), tmp_path_factory.mktemp("replicated"))
    trainer.run()
    return trainer


def test_fsdp_resumed_as_zero1_on_half_the_devices_ends_where_replicated_does(
    replicated_run, tmp_path
):
    workdir = tmp_path / "sharded"
    fsdp = Trainer(tiny_config(sharding="fsdp", **ONE_BATCH), workdir)
    seen = {}

    def crash_at_4(step, state):
        seen["params"] = state.params
        _crash_at(4)(step, state)

    with pytest.raises(Crash):
        fsdp.run(on_step=crash_at_4)  # the newest checkpoint: step 3, sharded 8 ways
    assert fsdp.train_step_for(0).layout.units, "nothing was sharded"
    kernels = [leaf for leaf in jax.tree.leaves(seen["params"]) if leaf.ndim == 4]
    # Every kernel of 1,024 values or more is split 8 ways; smaller ones stay whole.
    large = [k for k in kernels if k.size >= 1024]
    assert large and all(k.addressable_shards[0].data.size * 8 == k.size for k in large)

    resumed = Trainer(tiny_config(sharding="zero1", mesh="ring-4", **ONE_BATCH), workdir,
                      allow_config_change=True)  # fmt: skip
    assert resumed.run()["step"] == 7
    assert len(resumed.mesh.devices.flat) == 4
    # The same model to float32 rounding: the sums run in other orders on 8 and 4 devices.
    assert _max_difference(resumed.state.params, replicated_run.state.params) < 1e-5
    assert _max_difference(resumed.state.opt_state, replicated_run.state.opt_state) < 1e-5
