"""The trainer with a pipeline recipe: ``--set pipeline.*`` on a mesh with a stage axis trains,
evaluates, resumes exactly, sets the learning rate inside the flat optimizer state, and refuses
a mesh that does not match in one line."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_pipeline_step import assert_trees_close, cross_entropy, data, mlp_stages, reference
from test_trainer import Crash, _assert_trees_equal, _crash_at, assert_same_abstract, tiny_config

from jaxdist import meshes
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.step import PipelineStep
from jaxdist.run.checkpoint import CheckpointMismatchError, abstract_like
from jaxdist.run.config import ConfigError
from jaxdist.run.trainer import Trainer
from jaxdist.training import optim
from jaxdist.training.protocol import Step

PIPELINE = {
    "model.name": "resnet18",  # 10 layers for 4 stages
    "mesh": "pipeline-2x4",
    "pipeline.stages": 4,
    "pipeline.microbatches": 2,
    "pipeline.boundaries": (0, 3, 5, 7),  # ResNet-18: stem, 8 blocks, classifier
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The pipeline recipe trained start to end with explicit boundaries, no crash."""
    trainer = Trainer(tiny_config(**PIPELINE), tmp_path_factory.mktemp("straight"))
    trainer.summary = trainer.run()
    return trainer


def test_pipeline_recipe_trains_and_sets_the_learning_rate_in_every_stage(straight):
    summary = straight.summary
    assert summary["step"] == 7 and 0 <= summary["top1"] <= 1
    assert isinstance(straight.train_step_for(0), PipelineStep)
    assert isinstance(straight.train_step_for(0), Step)
    # The learning rate the schedule set last is in every stage's optimizer state.
    step = straight.train_step_for(0)
    stage, chunk, offset = step._learning_rate_at
    stored = np.asarray(straight.state.opt_state)[stage, chunk, offset]
    want = float(straight.parts.lr_fn(straight.parts.schedule.epoch_at(6)))
    np.testing.assert_allclose(stored, want, rtol=1e-6)


def test_learning_rate_and_lars_reach_every_stage():
    """LARS needs each layer whole: the optimizer sees each stage's tree, and the learning
    rate written into the flat state is the one the update uses."""
    batch = data()
    modules = mlp_stages(4)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)

    def lars():
        return optim.make_optimizer(
            "lars",
            0.1,
            momentum=0.9,
            nesterov=False,
            weight_decay=1e-4,
            trust_coefficient=0.001,
            eps=0.0,
        )

    step = PipelineStep(
        fns,
        cross_entropy,
        lars(),
        meshes.build("pipeline-2x4"),
        microbatches=3,
        inputs=lambda b: b["x"],
    )
    state = step.set_learning_rate(step.init(params, states), 0.5)
    for _ in range(2):
        state, _ = step(state, step.shard_batch(batch), jax.random.key(3))

    reference_optimizer = lars()
    init = reference_optimizer.init
    optimizer = optax.GradientTransformation(
        lambda p: optim.set_learning_rate(init(p), 0.5), reference_optimizer.update
    )
    want, _, _ = reference(fns, params, states, batch, optimizer, 6, 2)
    assert_trees_close(step.unstack(state)[0], want)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"mesh": "torus-2x4"},
            r"needs a mesh with a 'stage' axis; the mesh has axes \('y', 'x'\)",
        ),
        ({"mesh": "pipeline-2x2x2"}, "the mesh's 'stage' axis has 2 devices"),
        ({"pipeline.boundaries": (0, 5)}, "pipeline.boundaries has 2 entries; it needs one per"),
        (
            {"pipeline.schedule": "interleaved", "pipeline.chunks": 2},
            r"has 4 entries; it needs one per virtual stage \(8\)",
        ),
        ({"pipeline.schedule": "zero-bubble"}, "schedule must be one of gpipe, 1f1b, interleaved"),
        ({"pipeline.boundaries": (0, 5, 9, 12)}, "stay below the 10 layers"),
        # Every recipe field the step takes reaches it; what a pipeline cannot honour is
        # refused, never ignored.
        ({"sfb_layers": "all"}, "sfb_layers='all': a pipeline stage's gradients are one flat"),
        ({"allreduce": "auto"}, "allreduce='auto' chooses routes per gradient bucket"),
        ({"links": "10us:1GB/s"}, "links='10us:1GB/s' price a data-parallel gradient plan"),
        ({"max_per_device_batch": 8}, "accumulation_steps=2: a pipeline's micro-batches take"),
        ({"pipeline.chunks": 2}, "pipeline.chunks=2 is for the interleaved schedule"),
        ({"gather": "native"}, "sharding='replicated' keeps each stage's parameters whole"),
        ({"sharding": "zero1"}, "a pipeline shards a stage's parameters and optimizer state"),
        ({"sharding": "fsdp", "prefetch": 2}, "prefetch=2 paces a sharded step's parameter"),
        ({"sharding": "fsdp", "scatter_behind": True}, "scatter_behind=True paces a sharded"),
    ],
)
def test_bad_pipeline_config_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer(tiny_config(**{**PIPELINE, **overrides}), tmp_path)
    assert "\n" not in str(caught.value)


@pytest.mark.slow  # a second pipeline recipe run, under FSDP: about 100 s on 2 cores
def test_fsdp_inside_stages_trains_as_the_replicated_pipeline(straight, tmp_path):
    """``--set sharding=fsdp``: each stage's state split over the data axis, made straight
    into the shardings a checkpoint is restored into, ends where the replicated pipeline
    does (float32 rounding apart), with the learning rate written into every shard's
    optimizer state."""
    trainer = Trainer(tiny_config(**PIPELINE, sharding="fsdp"), tmp_path)
    assert_same_abstract(trainer.abstract_state(), abstract_like(trainer.initial_state()))
    assert trainer.run()["step"] == 7
    step = trainer.train_step_for(0)
    assert trainer.state.params.sharding.spec == P("stage", None, "data")
    got = step.whole_variables(trainer.state)
    want = straight.train_step_for(0).whole_variables(straight.state)
    assert_trees_close(got, want, atol=1e-5)
    stage, chunk, offset = step._learning_rate_at
    assert len(offset) == 4 * 2  # every stage's rate, once in each of its two shards
    stored = np.asarray(trainer.state.opt_state)[stage, chunk, offset]
    np.testing.assert_allclose(
        stored, float(trainer.parts.lr_fn(trainer.parts.schedule.epoch_at(6))), rtol=1e-6
    )


def test_a_pipeline_checkpoint_under_another_sharding_is_refused_saying_so(straight):
    """A pipeline stores each stage laid out for its sharding: resuming the replicated run
    under FSDP says that in one line (not "another model") and leaves the workdir as it was."""
    recorded = (straight.workdir / "config.json").read_text()
    again = Trainer(
        tiny_config(**PIPELINE, sharding="fsdp"), straight.workdir, allow_config_change=True
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"hold this pipeline under sharding="
        r"'replicated'.*rerun with --set sharding=replicated",
    ) as caught:
        again.run()
    assert "\n" not in str(caught.value)
    assert (straight.workdir / "config.json").read_text() == recorded


def test_micro_batches_that_do_not_divide_the_batch_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"batch of 16 does not split into pipeline\.microbatch"):
        Trainer(tiny_config(**{**PIPELINE, "pipeline.microbatches": 3}), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow  # two pipeline recipe runs: about 30 s
def test_auto_boundaries_cut_where_the_profile_says_and_resume_exactly(straight, tmp_path, capsys):
    """A profile whose only balanced cut is the explicit one: the auto run, crashed and
    resumed, equals the explicit run, records the cut, and the resume restores the state's
    shapes and shardings and reuses the cut without profiling again."""
    import json

    from jaxdist.pipeline.profile import LayerCost, Profile, layer_sizes

    capsys.readouterr()
    micro = 8  # the final batch of 32 on 2 replicas in 2 micro-batches
    example = jax.ShapeDtypeStruct((micro, *straight.parts.task.data.image_shape), "float32")
    sizes = layer_sizes(straight.parts.task.model, example)
    costs = [1, 1, 1, 1.5, 1.5, 1.5, 1.5, 1, 1, 1]  # stage sums 3, 3, 3, 3 only at (0, 3, 5, 7)
    layers = tuple(
        LayerCost(f"l{i}", c / 3, 2 * c / 3, 64, size, size, 0)
        for i, (c, size) in enumerate(zip(costs, sizes, strict=True))
    )
    path = tmp_path / "profile.json"
    Profile({"name": "resnet18"}, micro, "cpu", "measured", layers).write(path)

    auto = {**PIPELINE, "pipeline.boundaries": "auto", "pipeline.profile": str(path)}
    workdir = tmp_path / "auto"
    with pytest.raises(Crash):
        Trainer(tiny_config(**auto), workdir).run(on_step=_crash_at(4))
    assert "boundaries auto -> [0, 3, 5, 7]" in capsys.readouterr().out
    recorded = json.loads((workdir / "config.json").read_text())["devices"]
    assert recorded["pipeline_boundaries"] == [0, 3, 5, 7]
    path.unlink()  # the resume must not need the profile: the cut is recorded
    resumed = Trainer(tiny_config(**auto), workdir)
    assert_same_abstract(resumed.abstract_state(), abstract_like(resumed.initial_state()))
    assert resumed.run()["step"] == 7
    assert "boundaries auto" not in capsys.readouterr().out
    for field in ("params", "model_state", "opt_state"):
        _assert_trees_equal(getattr(resumed.state, field), getattr(straight.state, field), field)
