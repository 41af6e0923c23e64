"""The trainer with a sharded state: a ResNet recipe under FSDP equals the replicated run, and
a checkpoint written under one sharding and device count resumes under another."""

import jax
import numpy as np
import pytest

from jaxdist.run.trainer import Trainer
from tests.test_trainer import Crash, _crash_at, tiny_config


def _max_difference(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# One batch size throughout (no ramp): each run compiles one train step.
ONE_BATCH = {"batch_ramp": (), "model.name": "resnet18"}


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory):
    """The replicated reference, moved from 8 devices to 4 where the sharded run is: its first
    three steps on 8, the rest on 4. A run that stays on 8 is not a reference to float32
    rounding: summed over 4 devices instead of 8, the gradients round differently, and at
    this learning rate a step amplifies the difference 8-40 times (1e-6 after one step, 3e-2
    after six), by as much as the host's vector width decides."""
    workdir = tmp_path_factory.mktemp("replicated")
    with pytest.raises(Crash):
        Trainer(tiny_config(**ONE_BATCH), workdir).run(on_step=_crash_at(4))
    trainer = Trainer(tiny_config(mesh="ring-4", **ONE_BATCH), workdir, allow_config_change=True)
    assert trainer.run()["step"] == 7
    return trainer


@pytest.mark.slow  # three recipe runs on two device counts: about 80 s
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
    assert fsdp.train_step_for(0).placement.units, "nothing was sharded"
    kernels = [leaf for leaf in jax.tree.leaves(seen["params"]) if leaf.ndim == 4]
    # Every kernel of 1,024 values or more is split 8 ways; smaller ones stay whole.
    large = [k for k in kernels if k.size >= 1024]
    assert large and all(k.addressable_shards[0].data.size * 8 == k.size for k in large)

    resumed = Trainer(
        tiny_config(sharding="zero1", mesh="ring-4", **ONE_BATCH), workdir, allow_config_change=True
    )
    assert resumed.run()["step"] == 7
    assert len(resumed.parts.mesh.devices.flat) == 4
    # The same model as the replicated run over the same devices, to float32 rounding.
    assert _max_difference(resumed.state.params, replicated_run.state.params) < 1e-5
    assert _max_difference(resumed.state.opt_state, replicated_run.state.opt_state) < 1e-5
