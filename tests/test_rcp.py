"""The MLPerf reference convergence points: the epochs jaxdist plan takes for a batch are the
ones MLPerf's own RCP checker takes."""

import pytest

from jaxdist.aot import rcp
from jaxdist.run.config import load_recipe

rcp_checker = pytest.importorskip("mlperf_logging.rcp_checker.rcp_checker")


def _checker_epochs(batch):
    """The checker's reference mean for ``batch`` (its pruned pass), or None if it has none."""
    checker = rcp_checker.RCP_Checker("training", "4.0.0", "resnet", verbose=False)
    record = checker._find_rcp(batch, "pruned_rcps")
    if record is None:
        low = checker._find_top_min_rcp(batch, "pruned_rcps")
        high = checker._find_bottom_max_rcp(batch, "pruned_rcps")
        if low is None or high is None:
            return None if high is None else checker._find_min_rcp("pruned_rcps")["RCP Mean"]
        record = checker._create_interp_rcp(batch, low, high)[1]
    return record["RCP Mean"]


@pytest.mark.parametrize(
    "batch", [1024, 1632, 3264, 4096, 6000, 8192, 16384, 32768, 49152, 60000, 67840, 80000]
)
def test_epochs_are_the_rcp_checkers(batch):
    found = rcp.epochs_to_converge(batch)
    want = _checker_epochs(batch)
    assert (found.epochs is None) == (want is None), (batch, found, want)
    if want is not None:
        assert found.epochs == pytest.approx(want, rel=1e-12), (batch, found.how)


def test_how_the_epochs_were_found_is_said():
    assert rcp.epochs_to_converge(32768).how == "at the reference point"
    assert rcp.epochs_to_converge(32768).epochs == 56.0  # 10 runs, fastest and slowest dropped
    # 4,096 to 13,056 converge slower than the line from 3,264 to 32,768: pruned, as MLPerf does.
    between = rcp.epochs_to_converge(8192)
    assert between.how == "interpolated between 3,264 (35.2) and 32,768 (56.0)"
    assert rcp.epochs_to_converge(100_000).how == "beyond the table's largest batch, 67,840"


def test_the_mlperf_recipe_is_compared_with_the_reference_at_its_batch():
    config = load_recipe("recipes/resnet50_imagenet_mlperf_lars.py")
    point = rcp.epochs_to_converge(config.batch_size).nearest
    differences = rcp.hyperparameter_differences(config, point, bn_span=None)
    names = {name for name, _, _ in differences}
    assert "optimizer.name" not in names  # LARS, as the reference
    for name, mine, ref in differences:
        assert mine != ref, name
    config.optimizer.name = "sgd"
    assert ("optimizer.name", "sgd", "lars") in rcp.hyperparameter_differences(config, point, None)


def test_a_plan_of_the_mlperf_recipe_prices_the_reference_epochs():
    """What `jaxdist plan` adds for a ResNet-50 recipe, from its run's batch plan and the
    stages' step times (stand-in run parts: compiling ResNet-50 for a slice is slow)."""
    from types import SimpleNamespace

    from jaxdist.aot import record
    from jaxdist.aot.plan_reference import reference_for
    from jaxdist.aot.report import _reference_lines
    from jaxdist.aot.topology import parse_topology
    from jaxdist.run.config import batch_stages
    from jaxdist.training.batch_schedule import BatchSchedule

    config = load_recipe("recipes/resnet50_imagenet_mlperf_lars.py")
    schedule = BatchSchedule(batch_stages(config), dataset_size=1_281_167)
    parts = SimpleNamespace(
        task=SimpleNamespace(name="resnet50"),
        schedule=schedule,
        plans=schedule.device_plans(256, config.max_per_device_batch),
        num_replicas=256,
    )
    step_seconds = [0.1] * len(schedule.stages)
    topology = parse_topology("v4:4x8x8")  # 256 chips; the record holds TPU v4 submissions
    ref = reference_for(config, parts, step_seconds, topology, flops_per_image=24e9)
    found = rcp.epochs_to_converge(config.batch_size)
    assert ref["epochs"] == found.epochs and ref["recipe_epochs"] == config.num_epochs
    steps = schedule.steps_for_epochs(found.epochs)
    assert sum(row["steps"] for row in ref["time_rows"]) == steps
    assert ref["total_seconds"] == pytest.approx(0.1 * steps)
    lines = _reference_lines(ref)
    assert lines[1].startswith(
        f"MLPerf reference (MLPerf Training 4.0.0 reference convergence "
        f"points) at global batch {config.batch_size:,}: "
        f"{found.epochs:.1f} epochs to 75.9% top-1"
    )
    found_in_record = record.record_time("v4", 256, config.batch_size)
    assert ref["record"]["seconds"] == pytest.approx(found_in_record["seconds"])
    fitted = ref["record"]["fitted"]
    assert ref["record"]["share_of_peak"] == pytest.approx(
        fitted["images_per_second"] * 24e9 / topology.chip.peak_flops
    )
    (model_line,) = [line for line in lines if "the MLPerf record's model" in line]
    assert f"fitted on its {fitted['submissions']} submissions" in model_line
    on_v5e = reference_for(config, parts, step_seconds, parse_topology("v5e:16x16"), 24e9)
    assert "no scored MLPerf submission of v5e" in "\n".join(_reference_lines(on_v5e))
    config.model.name = "resnet18"
    parts.task.name = "resnet18"
    assert reference_for(config, parts, step_seconds, topology, 24e9) is None


def test_a_batch_beyond_the_table_has_no_reference_and_says_so():
    from jaxdist.aot.report import _reference_lines

    ref = {
        "source": "MLPerf Training 4.0.0 reference convergence points",
        "batch": 69_120,
        "epochs": None,
        "how": rcp.epochs_to_converge(69_120).how,
        "recipe_epochs": 90,
    }
    assert _reference_lines(ref) == [
        "",
        (
            "MLPerf reference (MLPerf Training 4.0.0 reference convergence points) at global batch "
            "69,120: none (beyond the table's largest batch, 67,840); the recipe's num_epochs: 90"
        ),
    ]
