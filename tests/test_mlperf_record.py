"""The MLPerf ResNet-50 record read as data, and the time model fitted on it.

``tests/data/mlperf`` holds a few real result logs and system descriptions of the public
record (Apache 2.0, LICENSE.md beside them), chosen for what a reader of the record meets: a
v0.7 description that writes ``number of nodes``, a TPU named only ``TPU``, a CPU-only
system, a run that stopped short of the target, and a log carried over into a later round.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from jaxdist.aot import record
from tests._procs import REPO, clean_env

BENCHMARKS = REPO / "benchmarks"
REAL_LOGS = REPO / "tests" / "data" / "mlperf"
sys.path.insert(0, str(BENCHMARKS))
import mlperf_record  # noqa: E402
import record_validation  # noqa: E402

sys.path.remove(str(BENCHMARKS))


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_real_logs_are_each_a_row_or_one_line_saying_why_not():
    runs, submissions, problems = mlperf_record.read_record([REAL_LOGS])
    assert len(problems) == 2, problems
    cpu, carried = sorted(problems)
    assert "1-node-8s-cpx-1-tensorflow" in cpu and "a CPU-only system" in cpu
    assert "training_results_v2.1" in carried and "carried over" in carried
    by_system = {s["system"]: s for s in submissions}
    assert set(by_system) == {"2xC4140", "tpu-v4-16-TF", "dgx1_ngc20.06_mxnet", "ESCN4A-E11"}
    dell = by_system["2xC4140"]  # "number of nodes": "2" x 4 V100s
    assert (dell["chips"], dell["hosts"], dell["generation"]) == (8, 2, "v100")
    tpu = by_system["tpu-v4-16-TF"]  # accelerator_model_name "TPU": the version from the name
    assert (tpu["generation"], tpu["chips"]) == ("v4", 8)
    carried_over = by_system["ESCN4A-E11"]
    assert (carried_over["round"], carried_over["runs"]) == ("v2.0", 1)
    assert carried_over["scored_seconds"] is None  # one run: MLPerf scores five
    # One run stopped short of 75.9% (aborted): it counts as the slowest and is dropped.
    nvidia = [r for r in runs if r["system"] == "dgx1_ngc20.06_mxnet"]
    failed = [r for r in nvidia if not r["success"]]
    assert len(failed) == 1 and failed[0]["status"] == "aborted"
    assert failed[0]["epochs_to_target"] is None and failed[0]["best_accuracy"] < 0.759
    successful = sorted(r["seconds"] for r in nvidia if r["success"])
    assert by_system["dgx1_ngc20.06_mxnet"]["scored_seconds"] == pytest.approx(
        sum(successful[1:]) / 3
    )


def test_a_description_without_chip_counts_is_one_line(tmp_path):
    described = tmp_path / "box.json"
    described.write_text(json.dumps({"number_of_nodes": "TBD", "accelerators_per_node": "8"}))
    with pytest.raises(mlperf_record.LogError, match="no number_of_nodes and accelerators"):
        mlperf_record.read_system(described)
    described.write_text(
        json.dumps(
            {
                "number of nodes": "16 nodes",
                "accelerators_per_node": 8,
                "accelerator_model_name": "NVIDIA A100-PCIe-80GB",
                "division": "close",
            }
        )
    )
    system = mlperf_record.read_system(described)
    assert (system["chips"], system["generation"], system["division"]) == (
        128,
        "a100-pcie",
        "closed",
    )


def _result_log(path, batch, run_ms, accuracies, status="success"):
    """An MLPerf result log as submitters' loggers write it (the :::MLLOG format)."""
    from jaxdist.run.mlperf import EventLog

    path.parent.mkdir(parents=True, exist_ok=True)
    log = EventLog(path)
    log.log("global_batch_size", batch, time_ms=1000)
    log.log("opt_name", "lars", time_ms=1000)
    log.log("model_bn_span", 128, time_ms=1000)
    log.log("run_start", time_ms=2000)
    for i, accuracy in enumerate(accuracies):
        log.log("eval_accuracy", accuracy, time_ms=3000 + i, epoch_num=4.0 * (i + 1))
    log.log("run_stop", time_ms=2000 + run_ms, status=status)
    log.close()


def test_the_script_scores_a_synthesized_tree_as_mlperf(tmp_path):
    repo = tmp_path / "training_results_v9.9" / "Acme"
    (repo / "systems").mkdir(parents=True)
    (repo / "systems" / "box_n2.json").write_text(
        json.dumps(
            {
                "number_of_nodes": 2,
                "accelerators_per_node": 8,
                "accelerator_model_name": "X1",
                "division": "closed",
            }
        )
    )
    runs = repo / "results" / "box_n2" / "resnet"
    for i, (seconds, accuracies) in enumerate(
        [(600, [0.5, 0.76]), (500, [0.6, 0.761]), (700, [0.7, 0.755, 0.77]), (400, [0.76])]
    ):
        _result_log(runs / f"result_{i}.txt", 3264, seconds * 1000, accuracies)
    _result_log(runs / "result_4.txt", 3264, 300_000, [0.70, 0.75], status="aborted")
    (runs / "result_5.txt").write_text("not a log\n")
    (repo / "results" / "nosystem" / "resnet").mkdir(parents=True)
    _result_log(repo / "results" / "nosystem" / "resnet" / "result_0.txt", 8, 1000, [0.8])
    out = tmp_path / "record.json"
    proc = _script(str(BENCHMARKS / "mlperf_record.py"), "--root", str(tmp_path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("mlperf_record:")]
    assert len(skipped) == 2, proc.stderr
    assert any("result_5.txt: no :::MLLOG lines" in s for s in skipped)
    assert any("nosystem.json: missing" in s for s in skipped)
    table = json.loads(out.read_text())
    assert len(table["runs"]) == 5
    row = next(r for r in table["runs"] if r["path"].endswith("result_2.txt"))
    assert (row["round"], row["submitter"], row["system"], row["chips"]) == (
        "v9.9",
        "Acme",
        "box_n2",
        16,
    )
    assert (row["per_chip_batch"], row["bn_span"], row["optimizer"]) == (204, 128, "lars")
    assert row["epochs_to_target"] == 12.0 and row["seconds"] == 700
    (submission,) = table["submissions"]
    # 400 500 600 700 and a failed run: the fastest and the failed one dropped.
    assert submission["scored_seconds"] == 600
    assert submission["epochs_to_target"] == [4.0, 8.0, 8.0, 12.0]
    missing = _script(
        str(BENCHMARKS / "mlperf_record.py"), "--root", str(tmp_path / "nowhere"), "--out", str(out)
    )
    assert missing.returncode == 2 and "found no folder" in missing.stderr
    assert "Traceback" not in missing.stderr


def _submissions(truth: record.RecordFit) -> list[dict]:
    """Submissions whose scores are ``truth``'s times exactly, over chips and batches."""
    rows = []
    for generation in truth.generations:
        for chips, per_chip in [(8, 256), (8, 64), (64, 51), (256, 32), (1024, 16), (16, 200)]:
            batch = chips * per_chip
            seconds = truth.seconds(generation, chips, batch, record.reference_epochs(batch))
            rows.append(
                {
                    "generation": generation,
                    "chips": chips,
                    "global_batch": batch,
                    "scored_seconds": seconds,
                    "division": "closed",
                }
            )
    return rows


def test_a_fit_recovers_the_figures_that_made_the_times():
    truth = record.RecordFit(
        {
            "a": record.Generation(3000.0, 5e-3, 0, (0, 0), (0, 0)),
            "b": record.Generation(7000.0, 2e-3, 0, (0, 0), (0, 0)),
        },
        "",
    )
    fitted = record.fit(record.fittable(_submissions(truth)))
    for name, g in truth.generations.items():
        assert fitted.generations[name].images_per_second == pytest.approx(
            g.images_per_second, rel=1e-4
        )
        assert fitted.generations[name].step_overhead == pytest.approx(g.step_overhead, rel=1e-3)
        assert fitted.generations[name].chips == (8, 1024)
    # Leave-one-out on exact data predicts each held-out time.
    rows = _submissions(truth)
    held = record_validation.leave_one_out(rows)
    assert max(abs(p / r["scored_seconds"] - 1) for p, r in zip(held, rows, strict=True)) < 1e-3


def test_the_stored_fit_says_where_a_plan_lies_outside_the_record():
    fitted = record.stored_fit()
    assert fitted is not None, "run python benchmarks/plan_validation.py"
    h100 = fitted.generations["h100"]
    inside = record.record_time("h100", 64, 64 * 50)
    assert inside["outside"] == [] and inside["epochs"] == pytest.approx(35.1, abs=0.1)
    steps = inside["epochs"] * math.ceil(record.IMAGENET_TRAIN_IMAGES / 3200)
    expected = steps * (50 / h100.images_per_second + h100.step_overhead)
    assert inside["seconds"] == pytest.approx(expected)
    beyond = record.record_time("h100", 8192, 8192 * 4)
    assert any("8,192 chips" in why for why in beyond["outside"])
    none = record.record_time("v5e", 256, 8192)
    assert none["seconds"] is None and "no scored MLPerf submission of v5e" in none["outside"][0]


def test_predict_scores_another_record_with_the_stored_fit():
    proc = _script(str(BENCHMARKS / "plan_validation.py"), "--predict", str(REAL_LOGS))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # The three scored closed submissions: two V100 and a TPU v4 system, each with a row.
    assert sum(line.startswith("| v0.7 |") for line in lines) == 3
    assert any(
        line.startswith("not predicted: v2.0 ASUSTeK ESCN4A-E11: no score") for line in lines
    )
    assert lines[-1].startswith("within ±20%: ") and " of 3; median |error| " in lines[-1]
