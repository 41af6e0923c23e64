"""The stage partitioner on synthetic profiles: known optimal cuts, optimality against every
cut, links, memory limits, and the errors of bad requests and foreign profiles."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from jaxdist.comm.cost_model import Link
from jaxdist.pipeline import schedules
from jaxdist.pipeline.partition import PartitionError, message_seconds, partition, stage_costs
from jaxdist.pipeline.profile import (
    LayerCost,
    Profile,
    ProfileMismatchError,
    read_profile,
)

FREE = Link(alpha=0.0, beta=0.0)  # sends cost nothing: compute alone decides


def profile_of(compute, activation=None, params=None, micro_batch=4) -> Profile:
    """Layers whose forward and backward together take ``compute[i]`` seconds (1 : 2)."""
    n = len(compute)
    activation = activation or [1000] * n
    params = params or [100] * n
    layers = tuple(
        LayerCost(f"layer{i}", c / 3, 2 * c / 3, activation[i], params[i], 2 * params[i], 0)
        for i, c in enumerate(compute)
    )
    return Profile({"name": "synthetic"}, micro_batch, "cpu", "measured", layers)


def slowest(profile, boundaries, link=FREE, stages=None):
    stages = stages or len(boundaries)
    live = schedules.build("1f1b", stages, stages).live_activations()
    return max(c.time_s for c in stage_costs(profile, boundaries, link, live))


@pytest.mark.parametrize(
    "compute, stages, boundaries",
    [
        ([1.0] * 8, 4, (0, 2, 4, 6)),  # uniform: equal counts
        ([1, 1, 1, 10, 1, 1, 1, 1], 3, (0, 3, 4)),  # one heavy layer stands alone
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, (0, 5, 7)),  # rising costs: fewer layers later
    ],
)
def test_known_optimal_cuts(compute, stages, boundaries):
    assert partition(profile_of(compute), stages, FREE).boundaries == boundaries


def test_the_cut_is_optimal_against_every_cut():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n, stages = int(rng.integers(3, 9)), int(rng.integers(1, 4))
        stages = min(stages, n)
        profile = profile_of(
            list(rng.uniform(0.1, 3.0, n)), activation=list(rng.integers(1, 10_000, n))
        )
        link = Link(alpha=1e-3, beta=1e-4)
        found = partition(profile, stages, link)
        best = min(
            slowest(profile, (0, *cuts), link, stages)
            for cuts in itertools.combinations(range(1, n), stages - 1)
        )
        assert found.slowest_s == pytest.approx(best), (trial, found.boundaries)


def test_sends_move_the_cut_off_a_large_activation():
    # Equal compute, but layer 2's output takes 3 s to send: cutting after it costs 3 s each way.
    profile = profile_of([1.0] * 6, activation=[10, 10, 3 * 10**9, 10, 10, 10])
    link = Link(alpha=0.0, beta=1e-9)  # 1 s per GB
    assert partition(profile, 2, FREE).boundaries == (0, 3)
    cut = partition(profile, 2, link)
    assert cut.boundaries in ((0, 2), (0, 4))
    assert cut.slowest_s == pytest.approx(4.0 + message_seconds(link, 10))


def test_the_memory_limit_is_respected():
    # Compute wants the cut in the middle; parameters of the last layers are heavy.
    profile = profile_of([1.0] * 6, params=[10, 10, 10, 10, 400, 400])
    free = partition(profile, 2, FREE)
    assert free.boundaries == (0, 3)
    assert max(s.memory_bytes for s in free.stages) > 3000
    limited = partition(profile, 2, FREE, memory_limit_bytes=3000)
    assert all(s.memory_bytes <= 3000 for s in limited.stages)
    # The two heavy layers and a stashed input do not fit together: the last one goes alone.
    assert limited.boundaries == (0, 5)


def test_a_limit_no_cut_meets_names_the_stage_and_the_overflow():
    profile = profile_of([1.0] * 4, params=[10, 10, 10, 2**30])
    with pytest.raises(PartitionError) as err:
        partition(profile, 2, FREE, memory_limit_bytes=2**30)
    message = str(err.value)
    assert message.startswith("no cut of 4 layers into 2 stages fits in 1.00 GiB per device")
    assert "(stage 1, layers 3-3), 3.00 GiB over" in message


def test_more_stages_than_layers_is_refused():
    with pytest.raises(
        PartitionError, match="5 stages need at least 5 layers, but the model has 4"
    ):
        partition(profile_of([1.0] * 4), 5, FREE)


def test_step_and_bubble_follow_the_schedule_table():
    # Equal stages whose forward and backward take one tick each: the table's own bubble.
    layers = tuple(LayerCost(f"l{i}", 1.0, 1.0, 8, 8, 8, 0) for i in range(4))
    profile = Profile({"name": "synthetic"}, 4, "cpu", "measured", layers)
    for name in ("gpipe", "1f1b"):
        cut = partition(profile, 4, FREE, schedule=name, microbatches=8)
        table = schedules.build(name, 4, 8)
        assert cut.step_seconds() == pytest.approx(table.ticks)
        assert cut.bubble() == pytest.approx(table.bubble_fraction)


def test_a_profile_round_trips_and_refuses_another_model(tmp_path):
    profile = profile_of([1.0, 2.0, 3.0], params=[10, 20, 30])
    path = tmp_path / "profile.json"
    profile.write(path)
    again = read_profile(path)
    assert again == profile
    again.check_matches({"name": "synthetic"}, 4, [10, 20, 30])
    with pytest.raises(ProfileMismatchError, match="the profile has 3 layers, the model 4"):
        again.check_matches({"name": "other"}, 4, [10, 20, 30, 40])
    with pytest.raises(ProfileMismatchError, match=r"layer 1 \(layer1\) has 20 parameter bytes"):
        again.check_matches({"name": "other"}, 4, [10, 21, 30])
    with pytest.raises(
        ProfileMismatchError, match="micro-batches of 4 images, the pipeline runs 8"
    ):
        again.check_matches({"name": "synthetic"}, 8, [10, 20, 30])
    path.write_text(json.dumps({"layers": [{"name": "x"}]}))
    with pytest.raises(ProfileMismatchError, match="is not a layer profile"):
        read_profile(path)


# --------------------------------------------------------------------------- profiles of models


def tiny_resnet():
    from jaxdist.models import ResNet

    return ResNet(stage_sizes=(1, 1), block="basic", num_classes=3, width=4, stem="small")


def test_a_measured_profile_has_every_layer_with_its_sizes():
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist.pipeline.profile import layer_sizes, measure_profile

    model = tiny_resnet()
    example = jnp.zeros((2, 8, 8, 3), jnp.float32)
    profile = measure_profile(
        model, example, optax.sgd(0.1, momentum=0.9), description={"name": "tiny"}, repeats=2
    )
    assert profile.layers[0].name.startswith("stem")
    assert len(profile.layers) == model.num_layers == 4  # stem, two blocks, classifier
    sizes = layer_sizes(model, jax.ShapeDtypeStruct(example.shape, example.dtype))
    assert [x.param_bytes for x in profile.layers] == sizes
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    assert all(x.optimizer_bytes == x.param_bytes for x in profile.layers)  # one momentum each
    # Outputs for one micro-batch: 8x8x4, 8x8x4, 4x4x8 (stride 2), then 3 logits.
    assert [x.activation_bytes for x in profile.layers] == [2 * 4 * n for n in (256, 256, 128, 3)]
    profile.check_matches({"name": "tiny"}, 2, sizes)


def test_a_compiler_profile_prices_layers_for_a_tpu_chip():
    import jax
    import optax

    from jaxdist.aot.layer_profile import compiler_profile
    from jaxdist.aot.topology import parse_topology

    model = tiny_resnet()
    example = jax.ShapeDtypeStruct((8, 8, 8, 3), "float32")
    profile = compiler_profile(
        model,
        example,
        optax.sgd(0.1),
        parse_topology("v5e:2x2"),
        description={"name": "tiny", "dtype": "float32"},
    )
    assert profile.source == "compiler" and profile.device.startswith("TPU v5e")
    assert len(profile.layers) == 4
    assert all(x.flops > 0 and x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    # The blocks' convolutions outweigh the classifier's 3 logits by far.
    blocks, head = profile.layers[1], profile.layers[3]
    assert blocks.flops > 50 * head.flops


@pytest.mark.slow  # a measured profile and a cut through the CLI: about 25 s
def test_cli_profiles_then_cuts_a_recipe_and_refuses_another_models_profile(tmp_path, capsys):
    from jaxdist.cli import main

    out = tmp_path / "profile.json"
    tiny = ["--set", "model.width=4"]
    assert (
        main(["pipeline", "profile", "mnist_pipeline", *tiny, "--out", str(out), "--repeats", "2"])
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    profile = read_profile(out)
    assert len(profile.layers) == 10 and profile.micro_batch == 4
    args = ["pipeline", "partition", "mnist_pipeline", *tiny, "--stages", "4"]
    assert main([*args, "--profile", str(out), "--link", "10us:1GB/s"]) == 0
    text = capsys.readouterr().out
    cut = partition(profile, 4, Link(10e-6, 1e-9), microbatches=4)
    assert f"boundaries: {list(cut.boundaries)}" in text
    assert "bubble" in text and "even cut [0, 3, 6, 9]" not in text  # 10 layers: no even cut
    assert main([*args, "--profile", str(out), "--set", "model.width=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "parameter bytes in the profile" in err and "\n" not in err
    assert main([*args, "--stages", "11", "--micro-batch", "4", "--profile", str(out)]) == 2
    assert "11 stages need at least 11 layers, but the model has 10" in capsys.readouterr().err


@pytest.mark.slow  # a measured profile through the trainer: about 15 s
def test_the_trainer_measures_a_profile_of_a_model_with_cross_replica_batchnorm():
    """The recipe's model averages BatchNorm statistics over the data axes; measured on one
    device outside the mesh, its profile uses each micro-batch's own."""
    import optax

    from jaxdist.run.config import base_config
    from jaxdist.run.from_config import StepParts
    from jaxdist.run.pipeline_config import profile_for
    from jaxdist.tasks import Replicas
    from jaxdist.tasks.image_classification import ImageClassification

    config = base_config()
    config.model.name, config.model.width, config.model.stem = "resnet10", 4, "small"
    config.data.source, config.data.image_size, config.data.num_classes = "synthetic", 8, 10
    config.data.synthetic_train_examples = config.data.synthetic_eval_examples = 4
    task = ImageClassification(config, Replicas("data", 2))
    parts = StepParts(task=task, optimizer=optax.sgd(0.1), options={})
    profile = profile_for(config, parts, micro=2)
    assert len(profile.layers) == 6 and profile.micro_batch == 2  # stem, 4 blocks, head
