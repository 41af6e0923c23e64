"""Sufficient-factor broadcasting and allreduce="auto" against the plain data-parallel step."""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import meshes
from jaxdist.comm import cost_model, hybrid
from jaxdist.training import train_step as ts
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.step_options import Communication
from tests._step_options import records

NUM_CLASSES = 10
STEPS = 3


class WideMLP(nn.Module):
    """Large dense layers, as in a VGG head, at a size a CPU test can afford."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(512, name="fc1")(x))
        x = nn.relu(nn.Dense(512, name="fc2")(x))
        return nn.Dense(NUM_CLASSES, name="head")(x)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Conv(4, (3, 3), name="conv")(x))
        return nn.Dense(NUM_CLASSES, name="head")(x.reshape(x.shape[0], -1))


def data(n=64, features=256, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((n, features)).astype(np.float32),
        "label": rng.integers(0, NUM_CLASSES, n).astype(np.int32),
    }


BATCHES = [data(seed=s) for s in range(STEPS)]


def train(mesh, batches=BATCHES, model=None, **options):
    model = model or WideMLP()
    params = model.init(jax.random.key(0), batches[0]["image"][:2])["params"]
    step = ts.TrainStep(
        classifier_loss(model, num_classes=NUM_CLASSES),
        optax.sgd(0.1, 0.9),
        mesh,
        **records(**options),
    )
    state = step.init(params)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
    return state, metrics, step


@pytest.fixture(scope="module")
def plain():
    """The plain step: ring allreduce of every gradient, one bucket."""
    return train(meshes.ring(8), allreduce="ring", bucket_bytes=None)[0]


def assert_trees_close(actual, expected, atol):
    for (path, a), e in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    ):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=0, atol=atol, err_msg=str(path)
        )


@pytest.mark.parametrize("bucket_bytes", [None, 1024])
@pytest.mark.parametrize("sfb_layers", ["all", ("fc2",)])
def test_sfb_equals_the_plain_step(plain, bucket_bytes, sfb_layers):
    state, metrics, step = train(
        meshes.ring(8), allreduce="ring", sfb_layers=sfb_layers, bucket_bytes=bucket_bytes
    )
    assert_trees_close(state.params, plain.params, atol=2e-6)
    factored = {layer.path for layer in step.plan().factored.values()}
    assert factored == ({"fc1", "fc2", "head"} if sfb_layers == "all" else {"fc2"})
    assert len(step.buckets) >= (1 if bucket_bytes is None else 2)
    assert np.isfinite(float(metrics["loss"]))


def test_sfb_on_a_two_axis_mesh_with_accumulation(plain):
    # Factors of every micro-batch are gathered: 4 micro-batches of 2 rows on each device.
    state, _, step = train(
        meshes.torus2d(4, 2),
        allreduce="torus2d",
        sfb_layers="all",
        accumulation_steps=4,
        data_axes=("y", "x"),
        bucket_bytes=2048,
    )
    assert_trees_close(state.params, plain.params, atol=2e-6)
    assert "8 rows" in step.plan().table()


def test_sfb_with_bf16_transfer_stays_close(plain):
    state, _, _ = train(
        meshes.ring(8),
        allreduce="ring",
        sfb_layers="all",
        allreduce_options={"transfer_dtype": jnp.bfloat16},
    )
    # bf16 factors carry 8 bits; three steps move the weights by ~1e-3 at most.
    assert_trees_close(state.params, plain.params, atol=2e-3)


def test_sfb_with_loss_scaling(plain):
    from jaxdist.training.loss_scale import DynamicLossScale

    state, _, _ = train(
        meshes.ring(8),
        allreduce="ring",
        sfb_layers="all",
        loss_scale=DynamicLossScale.create(2.0**8),
    )
    assert_trees_close(state.params, plain.params, atol=2e-6)


@pytest.mark.parametrize("link", ["50us:1gbit", "1ms:100gbit"])
def test_auto_equals_the_plain_step(plain, link):
    state, _, step = train(meshes.ring(8), allreduce="auto", links=link, bucket_bytes=4096)
    assert_trees_close(state.params, plain.params, atol=2e-6)
    plan = step.plan()
    assert set(plan.algorithms) <= set(hybrid.runnable_schedules((8,)))
    table = plan.table()
    for name in ("layer fc1", "layer fc2", "layer head", "bucket 0", "total:"):
        assert name in table


def test_auto_mixes_factors_and_dense_gradients():
    # 1 Gbit/s, no latency: factors win where 8 x 8 rows x (m + n) < 2 m n, i.e. for the two
    # 512-wide layers, not for the 512 x 10 head.
    _, _, step = train(meshes.ring(8), allreduce="auto", links="0us:1gbit", bucket_bytes=None)
    routes = {r.name: r.choice for r in step.plan().routes}
    assert routes["layer fc1"] == routes["layer fc2"] == hybrid.FACTORS
    assert routes["layer head"] == hybrid.DENSE
    assert sorted(layer.path for layer in step.plan().factored.values()) == ["fc1", "fc2"]


@pytest.mark.slow  # full-width ResNet-50 three times (about 70 s); small models cover the rest
def test_resnet50_classifier_as_factors():
    from jaxdist.models import init_variables, resnet50

    model = resnet50(num_classes=NUM_CLASSES, stem="small")
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.standard_normal((16, 8, 8, 3)).astype(np.float32),
        "label": rng.integers(0, NUM_CLASSES, 16).astype(np.int32),
    }
    variables = init_variables(model, jax.random.key(0), batch["image"][:2])
    params, model_state = variables.pop("params"), dict(variables)
    loss_fn = classifier_loss(model, num_classes=NUM_CLASSES)
    results = {}
    for name, options in {
        "plain": dict(allreduce="ring"),
        "sfb": dict(allreduce="ring", sfb_layers=["head"]),
        "auto": dict(allreduce="auto", links="0us:1gbit", bucket_bytes=None),
    }.items():
        step = ts.TrainStep(loss_fn, optax.sgd(0.1, 0.9), meshes.ring(8), **records(**options))
        state = step.init(params, model_state)
        state, _ = step(state, step.shard_batch(batch), jax.random.key(1))
        results[name] = (state, step)
    plain = results["plain"][0]
    for name in ("sfb", "auto"):
        state, step = results[name]
        assert_trees_close(state.params, plain.params, atol=2e-6)
        assert_trees_close(state.model_state, plain.model_state, atol=2e-6)
        routes = {r.name: r.choice for r in step.plan().routes}
        assert routes["layer head"] == hybrid.FACTORS, step.plan().table()
    assert len(results["sfb"][1].buckets) > 1  # the default 16 MiB buckets
    assert len(results["auto"][1].buckets) == 1


# ------------------------------------------------------------------ the chooser, synthetic links


def expected_factors_win(rows, m, n, devices, link):
    """What the cost model says, computed here from its formulas: the factor all-gather
    against the cheapest allreduce of the kernel."""
    gather = (devices - 1) * (link.alpha + rows * (m + n) * 4 * link.beta)
    dense = min(
        cost_model.predict(name, m * n * 4, (devices,), link)
        for name in hybrid.runnable_schedules((devices,))
    )
    return gather < dense


@pytest.mark.parametrize(
    ("rows", "m", "n", "factors"),
    [
        (32, 4096, 4096, True),  # small batch, wide layers (a VGG head on one device)
        (32, 25088, 4096, True),
        (4096, 64, 64, False),  # large batch, narrow layers
        (1024, 2048, 10, False),
        (32, 2048, 1000, True),  # ResNet-50's classifier at 32 images per device
        (256, 2048, 1000, False),  # ... and at 256
    ],
)
def test_the_chooser_picks_factors_exactly_where_the_model_says(rows, m, n, factors):
    links = hybrid.Links(cost_model.parse_link("50us:1gbit"))
    route = hybrid.route_dense_layer("layer", "", m * n * 4, rows * (m + n) * 4, (8,), links)
    assert (route.choice == hybrid.FACTORS) == factors
    assert factors == expected_factors_win(rows, m, n, 8, links.flat)


def test_the_chooser_agrees_with_the_model_on_a_sweep():
    rng = np.random.default_rng(0)
    for _ in range(300):
        devices = int(rng.choice([2, 4, 8, 16, 64]))
        rows, m, n = (int(v) for v in rng.integers(1, 4096, 3))
        link = cost_model.Link(
            float(rng.choice([0, 1e-6, 1e-4])), 1 / float(rng.choice([1e8, 1e10]))
        )
        route = hybrid.route_dense_layer(
            "l", "", m * n * 4, rows * (m + n) * 4, (devices,), hybrid.Links(link)
        )
        assert (route.choice == hybrid.FACTORS) == expected_factors_win(rows, m, n, devices, link)


@pytest.mark.parametrize(
    ("sizes", "absent", "present"),
    [
        ((8,), {"torus2d", "hierarchical"}, {"ring", "halving_doubling"}),
        ((6,), {"torus2d", "hierarchical", "halving_doubling"}, {"ring"}),
        ((3, 2), {"halving_doubling"}, {"torus2d", "hierarchical"}),
        ((4, 2), set(), {"torus2d", "halving_doubling"}),
    ],
)
def test_auto_never_picks_a_schedule_the_mesh_cannot_run(sizes, absent, present):
    runnable = set(hybrid.runnable_schedules(sizes))
    assert not runnable & absent and present <= runnable and "native" not in runnable
    rng = np.random.default_rng(1)
    for _ in range(100):
        link = cost_model.Link(float(rng.uniform(0, 1e-3)), 1 / float(rng.uniform(1e6, 1e12)))
        links = hybrid.Links(
            link, cost_model.Network(link, cost_model.Link(link.alpha * 10, link.beta * 10))
        )
        route = hybrid.route_bucket("b", "", int(rng.integers(1, 2**28)), sizes, links)
        assert route.choice in runnable


def test_auto_on_six_devices_runs_and_matches():
    mesh = meshes.ring(6, devices=jax.devices()[:6])
    batches = [data(n=48, seed=s) for s in range(2)]
    plain, _, _ = train(mesh, batches, allreduce="ring")
    state, _, step = train(mesh, batches, allreduce="auto", links="1us:100GB/s", bucket_bytes=4096)
    assert "halving_doubling" not in step.plan().algorithms
    assert_trees_close(state.params, plain.params, atol=2e-6)


# ------------------------------------------------------------------ links


def bench_json(path, axis_sizes, mesh="ring-8"):
    link = {"alpha_s": 5e-5, "beta_s_per_byte": 8e-9, "ports": 1}
    record = {"mesh": mesh, "axis_sizes": list(axis_sizes), "link": link}
    if len(axis_sizes) == 2:
        record["intra_link"] = {"alpha_s": 1e-6, "beta_s_per_byte": 1e-10, "ports": 1}
        record["inter_link"] = link
    path.write_text(json.dumps(record))
    return path


def test_links_from_a_bench_file(tmp_path):
    links = hybrid.resolve_links(str(bench_json(tmp_path / "l.json", (4, 2), "torus-4x2")), (4, 2))
    assert links.flat.alpha == 5e-5 and links.axes.intra.beta == 1e-10
    assert links.for_schedule("torus2d") is links.axes and links.for_schedule("ring") is links.flat


def test_links_from_the_emulated_cluster(monkeypatch):
    monkeypatch.setenv("JAXDIST_LINK_BITS_PER_S", str(10**9))
    monkeypatch.setenv("JAXDIST_LINK_LATENCY", "100us")
    links = hybrid.resolve_links(None, (4,))
    assert links.flat.alpha == pytest.approx(1e-4) and links.flat.bandwidth == pytest.approx(1.25e8)


# ------------------------------------------------------------------ bad input, one line each


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_auto_without_links_is_refused(monkeypatch):
    monkeypatch.delenv("JAXDIST_LINK_BITS_PER_S", raising=False)
    with pytest.raises(ValueError) as excinfo:
        ts.TrainStep(
            lambda *a: None, optax.sgd(0.1), meshes.ring(8), communication=Communication("auto")
        )
    message = one_line(excinfo)
    assert "needs link figures" in message and "LATENCY:BANDWIDTH" in message


def test_sfb_on_a_layer_that_is_not_dense():
    batches = [{"image": np.zeros((16, 4, 4, 1), np.float32), "label": np.zeros(16, np.int32)}]
    with pytest.raises(ValueError) as excinfo:
        train(meshes.ring(8), batches, model=ConvNet(), sfb_layers=["conv"])
    assert "'conv' is a Conv, not a dense layer" in one_line(excinfo)
    with pytest.raises(ValueError) as excinfo:
        train(meshes.ring(8), batches, model=ConvNet(), sfb_layers=["fc9"])
    assert "no module 'fc9'; its dense layers are: head" in one_line(excinfo)


def test_a_links_file_from_another_mesh(tmp_path):
    path = bench_json(tmp_path / "links.json", (8,))
    with pytest.raises(ValueError) as excinfo:
        ts.TrainStep(
            lambda *a: None,
            optax.sgd(0.1),
            meshes.torus2d(4, 2),
            communication=Communication("auto", links=str(path)),
        )
    message = one_line(excinfo)
    assert "measured on mesh ring-8 with axis sizes (8,)" in message and "(4, 2)" in message


def test_zero1_with_factors_or_auto_is_refused():
    for options in (dict(sfb_layers="all"), dict(allreduce="auto", links="5us:1gbit")):
        with pytest.raises(ValueError) as excinfo:
            ts.TrainStep(
                lambda *a: None,
                optax.sgd(0.1),
                meshes.ring(8),
                **records(sharding="zero1", **options),
            )
        assert "sharding='zero1'" in one_line(excinfo)


# ------------------------------------------------------------------ command line and config


def test_show_plan_command(capsys):
    from jaxdist.cli import main

    argv = [
        "bench",
        "train-step",
        "--mesh",
        "ring-8",
        "--show-plan",
        "auto",
        "--links",
        "50us:1gbit",
        "--per-device-batch",
        "4",
        "--width",
        "4",
        "--image-size",
        "8",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^layer head +\d+x10, 4 rows.* (sfb|dense) ", out, re.MULTILINE), out
    assert re.search(r"^bucket 0 ", out, re.MULTILINE) and "total:" in out, out


def test_show_plan_command_without_links(capsys, monkeypatch):
    from jaxdist.cli import main

    monkeypatch.delenv("JAXDIST_LINK_BITS_PER_S", raising=False)
    argv = ["bench", "train-step", "--mesh", "ring-8", "--show-plan", "auto", "--width", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdist bench: allreduce='auto' needs link figures") and "\n" not in err


@pytest.mark.parametrize(
    ("text", "setting"),
    [("", None), ("all", "all"), ("none", ()), ("head", ("head",)), (" fc1, fc2 ", ("fc1", "fc2"))],
)
def test_sfb_layers_setting(text, setting):
    from jaxdist.run.from_config import sfb_layers_setting

    assert sfb_layers_setting(text) == setting


def test_a_recipe_trains_with_auto_and_shows_its_plan(tmp_path, capsys):
    from jaxdist.run.trainer import Trainer
    from tests.test_trainer import tiny_config

    config = tiny_config(allreduce="auto", links="50us:1gbit", sfb_layers="head", max_steps=3)
    summary = Trainer(config, tmp_path / "run").run()
    assert summary["step"] == 3
    out = capsys.readouterr().out
    assert "gradient plan, 1 micro-batch(es) per step:" in out
    assert re.search(r"^layer head +32x10, 2 rows", out, re.MULTILINE), out
