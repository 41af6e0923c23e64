"""The scripts in ``benchmarks/`` that the docs cite still run, at sizes small enough for CI.

Their numbers are not checked (timing is not a test); what is checked is that each script
completes, prints or writes the rows the docs quote, and, where a script verifies its own
results (exchange_pieces.py compares every piece size's data), that the check passes.
"""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys

import pytest

from tests._procs import JAXDIST, REPO, clean_env

BENCHMARKS = REPO / "benchmarks"


def _run_process(argv: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"expected exit 0 from {argv}, found {proc.returncode}:\n{output}"
    return proc


def _run(argv: list[str], timeout: int = 240) -> str:
    proc = _run_process(argv, timeout)
    return proc.stdout + proc.stderr


def _launch(processes: int, *command: str) -> list[str]:
    return [*JAXDIST, "launch", "--processes", str(processes), "--timeout", "200", "--", *command]


def _launched_json(tmp_path, processes: int, script: str, args: list[str]) -> dict:
    """Run a benchmark script on ``processes`` local processes; the JSON it wrote."""
    out = tmp_path / "result.json"
    _run(_launch(processes, sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_exchange_pieces_checks_its_data_across_processes(tmp_path):
    args = ["--mib", "1", "--pieces", "none,256K,100000", "--iters", "1"]
    result = _launched_json(tmp_path, 2, "exchange_pieces.py", args)
    assert result["devices"] == 2 and result["mib"] == 1
    assert [row["piece"] for row in result["rows"]] == ["none", "256K", "100000"]
    assert all(row["seconds"] > 0 for row in result["rows"]), result


@pytest.mark.multiprocess
def test_gloo_reduce_scatter_times_each_collective_at_each_moment(tmp_path):
    result = _launched_json(tmp_path, 2, "gloo_reduce_scatter.py", ["--mib", "1", "--iters", "1"])
    assert result["processes"] == 2 and result["mib"] == 1
    moments = ["fresh", "after jaxdist's native reduce-scatter", "after XLA's psum_scatter"]
    assert [(row["moment"], row["collective"]) for row in result["rows"]] == [
        (moment, collective) for moment in moments for collective in ("psum", "ring allreduce")
    ], result
    assert all(row["seconds"] > 0 for row in result["rows"]), result


@pytest.mark.multiprocess
def test_ppermute_patterns_across_processes(tmp_path):
    result = _launched_json(tmp_path, 2, "ppermute_patterns.py", ["--sizes", "4K", "--iters", "1"])
    assert result["devices"] == 2 and result["processes"] == 2
    names = {row["pattern"] for row in result["rows"]}
    assert {"shift", "swap1", "shift_x4", "compute", "psum"} <= names, names


def test_ps_vs_ring_plot_draws_the_stored_results(tmp_path):
    out = tmp_path / "ps_vs_ring.png"
    _run([sys.executable, str(BENCHMARKS / "ps_vs_ring.py"), "plot", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _resnet50_pointwise_shapes() -> collections.Counter:
    """``(side, in channels, out channels, stride) -> count`` of ResNet-50 v1.5's 1x1
    convolutions at 224x224, from the architecture (not from the model's code): the stem leaves
    56x56x64; four stages of 3, 4, 6, 3 bottleneck blocks of 64, 128, 256, 512 filters, each
    a 1x1 reduce to the filters, a 3x3 (stride 2 in the first block of stages 2-4), a 1x1
    expand to 4x the filters; the first block of each stage projects its input with a 1x1
    convolution of the block's stride. 16 blocks x 2 + 4 projections = 36 convolutions."""
    shapes = collections.Counter()
    side, channels = 56, 64
    for stage, blocks in enumerate((3, 4, 6, 3)):
        filters = 64 * 2**stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            shapes[(side, channels, filters, 1)] += 1
            shapes[(side // stride, filters, 4 * filters, 1)] += 1
            if block == 0:
                shapes[(side, channels, 4 * filters, stride)] += 1
            side, channels = side // stride, 4 * filters
    return shapes


@pytest.mark.slow
def test_conv1x1_compares_every_layer(tmp_path):
    out = tmp_path / "conv.json"
    script = str(BENCHMARKS / "conv1x1.py")
    _run([sys.executable, script, "--batch", "1", "--rounds", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    shapes = collections.Counter()
    for row in result["rows"]:
        batch, height, width, channels = row["input"]
        assert batch == 1 and height == width, row
        key = (height, channels, row["features"], row["stride"])
        assert key not in shapes, f"{key} timed twice"
        shapes[key] = row["count"]
        times = {k: v for k, v in row.items() if k.endswith(" ms")}
        assert sorted(times) == [
            "conv forward ms",
            "conv forward+backward ms",
            "matmul forward ms",
            "matmul forward+backward ms",
        ], row
        assert all(math.isfinite(v) and v > 0 for v in times.values()), row
    expected = _resnet50_pointwise_shapes()
    assert sum(expected.values()) == 36 and len(expected) == 15
    assert shapes == expected


@pytest.mark.multiprocess
def test_queue_depth_runs_a_bounded_loop(tmp_path):
    out = tmp_path / "queue.json"
    script = str(BENCHMARKS / "queue_depth.py")
    args = ["--programs", "psum,train_step", "--depths", "4", "--calls", "50", "--repeats", "1"]
    _run([sys.executable, script, *args, "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["program"], r["depth"], r["finished"]) for r in rows] == [
        ("psum", "4", True),
        ("train_step", "4", True),
    ], rows


@pytest.mark.slow  # pipeline compiles replicated and sharded: about 20 s
def test_pipeline_memory_fsdp_keeps_a_quarter_of_each_stage_state(tmp_path):
    out = tmp_path / "memory.json"
    _run(
        [
            sys.executable,
            str(BENCHMARKS / "pipeline_memory.py"),
            "--stages",
            "2",
            "--replicas",
            "4",
            "--sharding",
            "replicated,fsdp",
            "--schedules",
            "1f1b",
            "--microbatches",
            "2",
            "--micro-batch",
            "64",
            "--json",
            str(out),
        ]
    )
    rows = {r["sharding"]: r for r in json.loads(out.read_text())}
    # A stage: four 1024-wide layers and Adam's two moments, 48 MiB; split 4 ways, 12 MiB.
    # The batch (1 MiB a replica) and the rng stay in the arguments.
    state = rows["replicated"]["argument_mib"] - rows["fsdp"]["argument_mib"]
    assert 35 < state < 37, rows
    assert rows["fsdp"]["peak_mib"] < rows["replicated"]["peak_mib"]


@pytest.mark.slow  # pipeline compiles at several micro-batch counts: about 30 s
def test_pipeline_memory_gpipe_grows_with_micro_batches_and_1f1b_does_not(tmp_path):
    out = tmp_path / "memory.json"
    _run(
        [
            sys.executable,
            str(BENCHMARKS / "pipeline_memory.py"),
            "--stages",
            "2",
            "--microbatches",
            "2,4,8",
            "--json",
            str(out),
        ]
    )
    rows = {(r["schedule"], r["microbatches"]): r for r in json.loads(out.read_text())}
    assert [rows["gpipe", m]["stash_slots"] for m in (2, 4, 8)] == [2, 4, 8]
    assert [rows["1f1b", m]["stash_slots"] for m in (2, 4, 8)] == [2, 2, 2]
    # The compiler's own figures: GPipe's 4 more stashed inputs (4 MiB each) from M = 4 to 8
    # show in its temporaries; 1F1B's stay as they were.
    gpipe_growth = rows["gpipe", 8]["temp_mib"] - rows["gpipe", 4]["temp_mib"]
    assert gpipe_growth >= 4 * 4 and rows["gpipe", 8]["temp_mib"] > rows["1f1b", 8]["temp_mib"]
    assert rows["1f1b", 8]["temp_mib"] == rows["1f1b", 4]["temp_mib"]


@pytest.mark.slow  # pipeline and data-parallel steps compiled: about 15 s
def test_pipeline_bytes_against_data_parallelism(tmp_path):
    out = tmp_path / "bytes.json"
    text = _run(
        [
            sys.executable,
            str(BENCHMARKS / "pipeline_bytes.py"),
            "--microbatches",
            "2",
            "--schedules",
            "gpipe,1f1b",
            "--json",
            str(out),
        ]
    )
    rows = {r["training"]: r for r in json.loads(out.read_text())["rows"]}
    assert "| data parallel, ring over 8 |" in text
    assert rows["pipeline gpipe"]["bytes_sent"] < rows["data parallel"]["bytes_sent"] / 2
    assert rows["pipeline gpipe"]["messages"] < rows["pipeline 1f1b"]["messages"]


@pytest.mark.slow
def test_hybrid_comm_times_every_route_and_variant(tmp_path):
    out = tmp_path / "hybrid.json"
    argv = [
        sys.executable,
        str(BENCHMARKS / "hybrid_comm.py"),
        "--model",
        "resnet50",
        "--per-device",
        "1",
        "--image-size",
        "32",
        "--iters",
        "1",
        "--link",
        "50us:1gbit",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        argv,
        env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["path"] for r in result["layers"]] == [
        "ring allreduce",
        "factors: all-gather",
        "factors: all-gather + rebuild",
    ]
    assert [r["variant"] for r in result["steps"]] == [
        "ring",
        "factors for head",
        "auto",
        "no averaging",
    ]
    assert all(r["seconds"] > 0 and r["bytes_sent"] > 0 for r in result["layers"])
    ring, factors = result["steps"][0], result["steps"][1]
    assert factors["bytes_sent"] < ring["bytes_sent"] and result["flops"] > 0
    assert "layer head  2048x1000, 1 rows" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_checkpoint_save_times_both_writings(tmp_path):
    out = tmp_path / "checkpoint_save.json"
    text = _run(
        [
            sys.executable,
            str(BENCHMARKS / "checkpoint_save.py"),
            "--rounds",
            "1",
            "--saves",
            "2",
            "--devices",
            "2",
            "--json",
            str(out),
        ],
        timeout=600,
    )
    assert "| replica-parallel |" in text and "| one writer per array |" in text, text
    seconds = json.loads(out.read_text())["seconds"]
    assert {name: [len(run) for run in runs] for name, runs in seconds.items()} == {
        "replica-parallel": [2],
        "one writer per array": [2],
        "one writer per array, with digests": [2],
    }


@pytest.mark.slow
def test_device_check_runs_its_small_mode_on_cpu(tmp_path):
    """The GPU check's every part on CPU: both steps timed, the chip's predicted step (asked
    for by name: a CPU has no entry in the chip table), both input pipelines (DALI decoding
    on the CPU) and an epoch end to end."""
    out = tmp_path / "device_check.json"
    text = _run(
        [
            sys.executable,
            str(BENCHMARKS / "device_check.py"),
            "--small",
            "--batches",
            "4",
            "--chip",
            "h100",
            "--out",
            str(out),
        ],
        timeout=600,
    )
    result = json.loads(out.read_text())
    (row,) = result["steps"]
    assert row["per_device_batch"] == 4 and row["chip"] == "h100"
    assert row["jaxdist_images_per_s"] > 0 and row["flax_example_images_per_s"] > 0
    assert row["flops_per_step"] > 0 and row["predicted_step_ms"] > 0
    # Off a GPU the count priced is the compiler's own; the matrix products' count leaves out
    # the elementwise ops (a large share of so narrow a model) and adds only padding taps.
    assert row["compiler_optimized_flops"] == row["flops_per_step"]
    assert 0.5 * row["flops_per_step"] < row["matrix_flops"] <= 1.05 * row["flops_per_step"]
    lm = result["lm"]
    assert lm["model"] == "transformer_lm" and lm["step_ms"] > 0 and lm["predicted_step_ms"] > 0
    assert lm["flops_per_step"] > 0 and 0 < lm["share_of_peak"] < 1
    # The LM is priced as the plan prices a transformer: its model FLOPs at the generation's
    # fitted utilization, not ResNet-50's calibration.
    assert "model FLOPs utilization" in lm["efficiency_note"] and "h100" in lm["efficiency_note"]
    assert 0 < lm["model_flops_utilization"] < lm["share_of_peak"]  # remat recomputes forward
    assert result["input_pipeline"]["images_per_s"] > 0 and result["dtype"] == "bfloat16"
    dali = result["input_pipeline"]["dali"]
    assert dali["decode"] == "cpu" and dali["images_per_s"] > 0 and dali["over_grain"] > 0
    e2e = result["end_to_end"]
    assert e2e["loader"] == "dali" and e2e["steps"] == 8 and e2e["per_device_batch"] == 8
    assert e2e["end_to_end_s"] > 0 and e2e["step_alone_s"] > 0
    assert "jaxdist img/s" in text and "transformer LM 2x64" in text
    assert "DALI loader (cpu decode)" in text and "an epoch of 8 steps at 8 per device" in text


def test_overlap_timeline_says_where_the_step_time_goes():
    """Busy, stalled and network shares per slice of a walked step, from its intervals: the
    compute runs 0-1 ms and 2-4 ms, waiting 1-2 ms for a gradient transfer of 1-2 ms."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import overlap_timeline
    finally:
        sys.path.remove(str(BENCHMARKS))
    from jaxdist.aot.timeline import Timeline

    timeline = Timeline(
        step_seconds=4e-3,
        busy=[(0.0, 1e-3), (2e-3, 4e-3)],
        transfers=[("gradients", 1e-3, 2e-3), ("batchnorm", 0.0, 4e-3)],
    )
    assert overlap_timeline.utilisation(timeline, 2) == [
        "| ms | compute busy | compute stalled | network (gradients) |",
        "|---|---|---|---|",
        "| 0.00-2.00 | 50% | 50% | 50% |",
        "| 2.00-4.00 | 100% | 0% | 0% |",
    ]
