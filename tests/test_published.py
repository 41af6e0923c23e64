"""The time model against published runs: each run's gradient buckets priced as the run made
its all-reduce (the TPU compiler's on the torus, NCCL between GPU hosts, or a paper's own
schedule), through the same step rule as a plan; calibration; bad stored facts."""

import dataclasses
import importlib.util
import json
import math

import pytest

from jaxdist.aot import predict, published
from jaxdist.aot.chips import CHIPS, network_for
from jaxdist.comm import cost_model
from tests._procs import REPO

MIB = 2**20
FACTS = published.ModelFacts(
    flops_per_image=24e9,
    gradient_bytes=100 * MIB,
    bucket_bytes=(16 * MIB,) * 6 + (4 * MIB,),
    gradient_hidden_fraction=0.75,
    measured_on="made up for the test",
)
RUNS = {run.name: run for run in published.PUBLISHED_RUNS}


def expected_seconds(run, per_bucket, efficiency):
    """Steps x (compute + buckets - hidden), every term written out here."""
    chip = CHIPS[run.chip]
    peak = chip.peak_flops_fp32 if run.precision == "fp32" else chip.peak_flops
    total, start = 0.0, 0.0
    for until, batch in run.batches:
        compute = FACTS.flops_per_image * batch / run.chips / (peak * efficiency)
        hidden = sum(per_bucket) * FACTS.gradient_hidden_fraction
        steps = math.ceil((until - start) * 1_281_167 / batch)
        total += steps * (compute + sum(per_bucket) - hidden)
        start = until
    return total


def test_a_tpu_run_is_priced_as_the_compilers_all_reduce_over_the_torus():
    run = RUNS["MLPerf v1.0 Google TPU v4"]
    assert run.allreduce == "xla" and run.host_network is None
    chip = CHIPS[run.chip]
    link = network_for(chip).intra
    per_dimension = math.ceil(round(run.chips ** (1 / chip.torus_dims), 9))  # 3,456 -> 16
    per_bucket = [
        2 * chip.torus_dims * (per_dimension - 1) * link.alpha
        + 2 * (run.chips - 1) / run.chips * b * link.beta / link.ports
        for b in FACTS.bucket_bytes  # float32 gradients on a TPU
    ]
    assert published.gradient_bucket_seconds(run, FACTS) == pytest.approx(per_bucket)
    predicted = published.predict_run(run, FACTS, 0.2)
    assert predicted["seconds"] == pytest.approx(expected_seconds(run, per_bucket, 0.2))


def test_a_gpu_run_is_priced_as_nccl_inside_and_between_hosts():
    run = RUNS["MLPerf v3.0 CoreWeave HGX H100"]  # 448 hosts of 8
    assert run.allreduce == "nccl"
    network = network_for(CHIPS[run.chip], host_network=run.host_network)
    fast, slow = network.intra, network.inter
    hosts = run.chips // run.inner
    per_bucket, tree_between = [], []
    for b in FACTS.bucket_bytes:
        b = b / 2  # 16-bit gradients on the wire
        inside = min(
            2 * (run.inner - 1) * (fast.alpha + b / run.inner * fast.beta),  # NVLink ring
            2 * math.log2(run.inner) * (fast.alpha + b * fast.beta),  # NVLink tree
        )
        part = b / run.inner  # between hosts each GPU's share
        ring = 2 * (hosts - 1) * (slow.alpha + part / hosts * slow.beta)
        tree = 2 * math.log2(hosts) * (slow.alpha + part * slow.beta)
        per_bucket.append(inside + min(ring, tree))
        tree_between.append(tree < ring)
    assert published.gradient_bucket_seconds(run, FACTS) == pytest.approx(per_bucket)
    assert all(tree_between)  # over 448 hosts the tree's 18 messages beat the ring's 894
    predicted = published.predict_run(run, FACTS, 0.2)
    assert predicted["seconds"] == pytest.approx(expected_seconds(run, per_bucket, 0.2))


def test_a_papers_own_schedule_is_priced_by_the_cost_model():
    run = RUNS["Mikami et al. 2018 (v1)"]
    assert run.allreduce == "torus2d"
    network = network_for(CHIPS[run.chip], host_network=run.host_network)
    axis_sizes = [run.chips // run.inner, run.inner]
    per_bucket = [
        cost_model.predict("torus2d", b / 2, axis_sizes, network) for b in FACTS.bucket_bytes
    ]
    assert published.gradient_bucket_seconds(run, FACTS) == pytest.approx(per_bucket)
    predicted = published.predict_run(run, FACTS, 0.2)  # two batch-size stages
    assert predicted["seconds"] == pytest.approx(expected_seconds(run, per_bucket, 0.2))


def test_a_published_run_hides_the_walked_share_of_its_buckets():
    per_bucket = [3e-3, 2e-3, 1e-3]
    step = predict.step_time(10e-3, per_bucket, 0.5, 0.2)
    # Half of the buckets' 6 ms is hidden: the share a walked program hid of its own.
    assert step.hidden == pytest.approx(3e-3)
    assert step.hidden_fraction == pytest.approx(0.5)
    assert step.total == pytest.approx(10e-3 + 6e-3 - 3e-3)
    assert predict.step_time(1e-3, per_bucket, 1.0, 0.2).total == pytest.approx(1e-3)
    assert predict.step_time(10e-3, [4e-3], 0.0, 0.2).hidden == 0.0


def test_calibration_finds_the_efficiency_that_gives_the_published_time():
    run = RUNS[published.CALIBRATION_RUN]
    efficiency = published.calibrate(run, FACTS)
    assert 0 < efficiency < 1
    assert published.predict_run(run, FACTS, efficiency)["seconds"] == pytest.approx(
        run.seconds, rel=1e-6
    )


def test_stored_facts_of_another_version_are_one_line(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(
        "plan_validation", REPO / "benchmarks" / "plan_validation.py"
    )
    plan_validation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_validation)
    old = dataclasses.asdict(FACTS)
    del old["bucket_bytes"]
    stored = tmp_path / "calibration.json"
    stored.write_text(json.dumps({"efficiency": 0.2, "run": "x", "facts": old}))
    monkeypatch.setattr(published, "CALIBRATION_FILE", stored)
    assert plan_validation.main(["--reuse-facts"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bucket_bytes" in err and "run without --reuse-facts" in err, err


def _all_reduces(sizes: list[int], group: int) -> str:
    """A compiled program of one gradient all-reduce per size over groups of ``group``."""
    lines = []
    for k, size in enumerate(sizes):
        lines += [
            f"  %g.{k} = f32[{size // 4}]{{0}} parameter({k})",
            f"  %ar.{k} = f32[{size // 4}]{{0}} all-reduce(%g.{k}), replica_groups=[1,{group}]<="
            f'[{group}], to_apply=%add, metadata={{op_name="jit(step)/gradient_sync/psum"}}',
        ]
    return "HloModule step\n\nENTRY %main () -> f32[] {\n" + "\n".join(lines) + "\n}\n"


def test_a_plans_native_step_is_priced_as_the_compilers_all_reduce():
    """``native`` is ``lax.psum``: the compiler's own all-reduce, priced as a published TPU
    run's is (over the torus in one slice; inside each host, then between hosts, on GPUs)."""
    from jaxdist.aot.compile import CompiledStep
    from jaxdist.aot.schedule import Schedule

    buckets = [16 * MIB, 8 * MIB]
    compiled = CompiledStep(
        1.0,
        None,
        1e12,
        Schedule(),
        sum(buckets),
        buckets,
        text=_all_reduces(buckets, 256),
        num_devices=256,
    )
    v4 = CHIPS["v4"]
    network = network_for(v4)
    step = predict.predict_step(compiled, v4, efficiency=0.5, network=network)
    torus = [predict.all_reduce_seconds(256, b, network.intra, 3) for b in buckets]
    assert step.communication == pytest.approx(sum(torus))
    assert step.hidden == 0  # synchronous: nothing runs beside them
    assert step.communication < sum(
        cost_model.predict("ring", b, (16, 16), network) for b in buckets
    )  # 30 messages per bucket over the torus, 510 around a ring
    h100 = CHIPS["h100"]
    hosts = network_for(h100, host_network=h100.host_network)
    compiled.text, compiled.num_devices = _all_reduces(buckets, 32), 32
    step = predict.predict_step(compiled, h100, efficiency=0.5, network=hosts, fast_group=8)
    expected = [predict.library_allreduce_seconds(b, 32, 8, hosts) for b in buckets]
    assert step.communication == pytest.approx(sum(expected))
    assert step.total == pytest.approx(step.compute + sum(expected))
    assert expected[0] == pytest.approx(
        predict.all_reduce_seconds(8, buckets[0], hosts.intra)
        + predict.all_reduce_seconds(4, buckets[0] / 8, hosts.inter)
    )


def test_a_fit_recovers_the_efficiency_that_made_the_times():
    runs = [RUNS["MLPerf v1.0 Google TPU v4"], RUNS["MLPerf v3.0 CoreWeave HGX H100"]]
    made = [
        dataclasses.replace(run, seconds=published.predict_run(run, FACTS, 0.31)["seconds"])
        for run in runs
    ]
    assert published.fit_efficiency(made, FACTS) == pytest.approx(0.31, rel=1e-4)


def test_each_generation_is_fitted_on_its_own_runs_and_a_plan_says_which(tmp_path, monkeypatch):
    fits = published.fit_by_generation(FACTS)
    assert set(fits) == {"v3", "v4", "v100", "a100", "h100"}  # MLPerf runs only, no P100
    assert fits["v4"]["runs"] == [name for name in published.MLPERF_RUNS if "TPU v4" in name]
    assert fits["h100"]["efficiency"] == pytest.approx(
        published.fit_efficiency([RUNS[name] for name in fits["h100"]["runs"]], FACTS)
    )

    monkeypatch.setattr(published, "CALIBRATION_FILE", tmp_path / "calibration.json")
    run = RUNS[published.CALIBRATION_RUN]
    published.write_calibration(run, FACTS, 0.2, fits)
    efficiency, note = published.calibrated_efficiency("h100")
    assert efficiency == fits["h100"]["efficiency"]
    assert "fitted on the 3 MLPerf runs of h100" in note
    efficiency, note = published.calibrated_efficiency("v5e")
    assert efficiency == 0.2
    assert f"calibrated on {run.name}; no MLPerf run of v5e to fit on" in note


def test_leave_one_out_scores_a_run_only_against_others_of_its_generation():
    rows = {r["run"]: r for r in published.leave_one_out_by_generation(FACTS)}
    assert len(rows) == len(published.MLPERF_RUNS) == 11
    alone = rows["MLPerf v0.6 NVIDIA DGX-2H"]  # the only V100 among them
    assert alone["error"] is None and alone["why"] == "no other MLPerf run of v100"
    a100 = rows["MLPerf v0.7 NVIDIA DGX A100"]
    assert a100["fitted_on"] == ["MLPerf v2.0 NVIDIA DGX A100"]
    held_out = RUNS["MLPerf v0.7 NVIDIA DGX A100"]
    efficiency = published.fit_efficiency([RUNS["MLPerf v2.0 NVIDIA DGX A100"]], FACTS)
    predicted = published.predict_run(held_out, FACTS, efficiency)["seconds"]
    assert a100["error"] == pytest.approx(predicted / held_out.seconds - 1)
