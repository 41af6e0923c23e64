"""The train-step benchmark (jaxdist.bench.train_step) and `jaxdist bench train-step`."""

import json
import math
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.bench import train_step as bench_train
from jaxdist.cli import main
from jaxdist.comm import buckets as bucketing
from jaxdist.training import train_step as ts
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.step_options import NO_ALLREDUCE, Communication


@pytest.mark.slow  # every variant compiled and timed: about a minute
def test_train_step_bench_runs_end_to_end(tmp_path, capsys):
    out_json = tmp_path / "train_step.json"
    argv = [
        "bench",
        "train-step",
        "--mesh",
        "torus-4x2",
        "--algorithms",
        "ring",
        "--per-device-batch",
        "2",
        "--image-size",
        "8",
        "--width",
        "4",
        "--steps",
        "1",
        "--rounds",
        "2",
        "--wait-free",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    # One row per variant asked for, after the baseline; the compute-only twins ("/none") are
    # folded into their rows, not reported as variants of their own; a permute schedule also
    # runs wait-free, against the same twin (the rest: the test of the variant list below).
    assert [r["variant"] for r in rows] == ["baseline", "jaxdist ring", "jaxdist ring wait-free"]
    global_batch = 2 * 8  # --per-device-batch 2 on the 8 devices of torus-4x2
    baseline = rows[0]
    for row in rows:
        for key in ("step_seconds", "compute_seconds", "images_per_second", "vs_baseline"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert math.isfinite(row["communication_seconds"]), row
        # Images/s counts the whole global batch once per step ...
        assert row["images_per_second"] * row["step_seconds"] == pytest.approx(global_batch), row
        # ... and each row is rated against the baseline's step, not its own or its twin's.
        assert row["vs_baseline"] == pytest.approx(baseline["step_seconds"] / row["step_seconds"])
        assert row["communication_seconds"] == pytest.approx(
            row["step_seconds"] - row["compute_seconds"]
        )
    # The table prints the same numbers as the JSON, one line per row, in its columns.
    printed = {
        name: [float(cell) for cell in cells.split()]
        for name, cells in re.findall(
            r"^(baseline|jaxdist \w+(?: wait-free)?)((?: +-?\d+\.\d+){6})$", table, re.MULTILINE
        )
    }
    assert list(printed) == [r["variant"] for r in rows], table
    for row in rows:
        step_ms, images, ratio, compute_ms, comm_ms, spread_ms = printed[row["variant"]]
        assert step_ms == pytest.approx(row["step_seconds"] * 1e3, abs=0.051), table
        assert images == pytest.approx(row["images_per_second"], abs=0.051), table
        assert ratio == pytest.approx(row["vs_baseline"], abs=0.00051), table
        assert compute_ms == pytest.approx(row["compute_seconds"] * 1e3, abs=0.051), table
        assert comm_ms == pytest.approx(row["communication_seconds"] * 1e3, abs=0.051), table
        spread = row["communication_spread_seconds"]
        assert math.isfinite(spread) and spread >= 0, row
        assert spread_ms == pytest.approx(spread * 1e3, abs=0.051), table
    assert "comm = step - compute" in table and "+-: half its spread" in table


def test_variants_in_the_order_asked_and_wait_free_only_for_permute_schedules():
    names = [name for name, _, _ in bench_train._jaxdist_variants(("ring", "native", "auto"), True)]
    assert names == [
        "jaxdist ring",
        "jaxdist ring/none",
        "jaxdist ring wait-free",
        "jaxdist native",
        "jaxdist native/none",
        "jaxdist auto",
        "jaxdist auto/none",
    ]
    twins = [allreduce for name, allreduce, _ in bench_train._jaxdist_variants(["ring"], False)]
    assert twins == ["ring", NO_ALLREDUCE]
    times = {name: [0.01] for name in ["baseline", "baseline/none", *names]}
    rows = bench_train._measurements(times, global_batch=16)
    assert [r.variant for r in rows] == [
        "baseline",
        "jaxdist ring",
        "jaxdist ring wait-free",
        "jaxdist native",
        "jaxdist auto",
    ]


def _small_run():
    """The benchmark's model on torus-4x2, its initial variables and one sharded batch."""
    mesh = meshes.build("torus-4x2")
    axes = tuple(mesh.axis_names)
    num_classes, width = 10, 4
    model = bench_train.small_resnet(axes, width, num_classes)
    init_model = bench_train.small_resnet(None, width, num_classes)
    rng = np.random.default_rng(0)
    host_batch = {
        "image": rng.standard_normal((2 * mesh.size, 8, 8, 3)).astype(np.float32),
        "label": rng.integers(0, num_classes, 2 * mesh.size).astype(np.int32),
    }
    variables = jax.device_get(
        init_model.init(jax.random.key(0), host_batch["image"][:2], train=False)
    )
    return mesh, axes, model, num_classes, variables, ts.shard_batch(mesh, axes, host_batch)


def _baseline_run(optimizer, communicate=True, **kwargs):
    """Two steps of the hand-written baseline: (losses, params, BatchNorm statistics)."""
    mesh, axes, model, _, variables, batch = _small_run()
    step = bench_train.baseline_step(model, optimizer, mesh, axes, communicate, **kwargs)
    carry = jax.device_put(
        [variables["params"], variables["batch_stats"], optimizer.init(variables["params"])],
        NamedSharding(mesh, P()),
    )
    losses = []
    for _ in range(2):
        params, stats, opt_state, metrics = step(*carry, batch)
        carry = [params, stats, opt_state]
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(carry[0]), jax.device_get(carry[1])


def _jaxdist_run(optimizer, allreduce):
    """Two steps of jaxdist's TrainStep, built as the benchmark builds it."""
    mesh, _, model, num_classes, variables, batch = _small_run()
    step = ts.TrainStep(
        classifier_loss(model, num_classes=num_classes),
        optimizer,
        mesh,
        communication=Communication(allreduce, bucket_bytes=bucketing.DEFAULT_BUCKET_BYTES),
    )
    state = step.init(variables["params"], {"batch_stats": variables["batch_stats"]})
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    params, stats = jax.device_get((state.params, state.model_state["batch_stats"]))
    return losses, params, stats


def _assert_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), a, b)


def _differs(a, b):
    return any(
        not np.allclose(x, y, rtol=1e-4, atol=1e-6)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.slow  # both ResNet steps trained: about 30 s
def test_baseline_and_jaxdist_steps_train_alike():
    """What the benchmark compares is the same training: from the same state and batch, the
    hand-written baseline step and jaxdist's TrainStep (built as the benchmark builds them)
    give the same loss, parameters and BatchNorm statistics, step after step; and each
    compute-only twin really leaves the gradient mean out (its parameters differ)."""
    optimizer = optax.sgd(0.1, momentum=0.9)
    initial = _small_run()[4]["params"]
    losses, params, stats = _baseline_run(optimizer)
    assert all(math.isfinite(loss) for loss in losses) and losses[0] != losses[1], losses
    assert _differs(params, initial)  # the step trained something
    for algorithm in ("native", "ring"):
        theirs = _jaxdist_run(optimizer, algorithm)
        np.testing.assert_allclose(theirs[0], losses, rtol=1e-5)
        _assert_close(theirs[1], params)
        _assert_close(theirs[2], stats)
    assert _differs(_baseline_run(optimizer, communicate=False)[1], params)
    assert _differs(_jaxdist_run(optimizer, NO_ALLREDUCE)[1], params)


@pytest.mark.slow  # both ResNet steps compiled and compared: about 40 s
def test_the_resnet_benchmarks_flax_example_step_is_the_baseline_with_l2_decay():
    """`jaxdist bench resnet` times the same hand-written step as the baseline here, with the
    flax example's L2 term (0.5 * wd * |w|^2 over kernels): it trains as TrainStep does with
    the flax example's optimizer (jaxdist.training.optim.sgd_momentum). The decay is 1e-2
    here, not the example's 1e-4, so that a wrong term would show beyond the tolerance."""
    from jaxdist.bench import resnet as resnet_bench
    from jaxdist.training import optim

    assert resnet_bench.baseline_step is bench_train.baseline_step
    example = optax.sgd(0.1, momentum=0.9, nesterov=True)
    losses, params, stats = _baseline_run(example, weight_decay=1e-2, donate=False)
    theirs = _jaxdist_run(optim.sgd_momentum(0.1, weight_decay=1e-2), "native")
    np.testing.assert_allclose(theirs[0], losses, rtol=1e-5)
    _assert_close(theirs[1], params)
    _assert_close(theirs[2], stats)
    assert _differs(_baseline_run(example)[1], params)  # the decay did something


def test_communication_is_paired_by_round_and_carries_its_spread():
    # Two rounds: the allreduce adds 2 ms in one and nothing in the other (it overlapped).
    times = {
        "baseline": [0.010, 0.012],
        "baseline/none": [0.009, 0.011],
        "jaxdist ring": [0.013, 0.010],
        "jaxdist ring/none": [0.011, 0.010],
    }
    baseline, ring = bench_train._measurements(times, global_batch=16)
    assert (baseline.variant, ring.variant) == ("baseline", "jaxdist ring")
    assert ring.communication_seconds == pytest.approx(0.0115 - 0.0105)
    assert ring.communication_spread_seconds == pytest.approx((0.002 - 0.0) / 2)
    assert baseline.communication_spread_seconds == pytest.approx(0.0)
    assert ring.vs_baseline == pytest.approx(0.011 / 0.0115)


@pytest.mark.slow  # every sharding compiled and timed: about 20 s
def test_sharding_bench_compares_every_sharding_and_xlas_fsdp(tmp_path, capsys):
    out_json = tmp_path / "sharding.json"
    argv = [
        "bench",
        "train-step",
        "--sharding",
        "--mesh",
        "ring-4",
        "--algorithms",
        "ring",
        "--per-device-batch",
        "1",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())}
    assert list(rows) == ["replicated", "zero1", "fsdp (ring)", "XLA FSDP (jit + NamedSharding)"]
    assert "vs XLA FSDP" in capsys.readouterr().out
    # The same model trained the same steps: the same loss to float32 rounding.
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-5
    xla = rows["XLA FSDP (jit + NamedSharding)"]
    assert xla["vs_xla_fsdp"] == 1.0 and rows["replicated"]["vs_replicated"] == 1.0
    # Less state per device from replicated to ZeRO-1 to FSDP; XLA's FSDP holds FSDP's layout.
    assert rows["fsdp (ring)"]["state_bytes"] < rows["zero1"]["state_bytes"]
    assert rows["zero1"]["state_bytes"] < rows["replicated"]["state_bytes"]
    assert rows["fsdp (ring)"]["state_bytes"] == xla["state_bytes"]
