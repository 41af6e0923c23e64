"""The scripts in ``benchmarks/`` that the docs cite still run, at sizes small enough for CI.

Their numbers are not checked (timing is not a test); what is checked is that each script
completes, prints or writes the rows the docs quote, and, where a script verifies its own
results (exchange_pieces.py compares every piece size's data), that the check passes.
"""

from __future__ import annotations

import collections
import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from tests._procs import JAXDIST, REPO, clean_env
from tests.test_cluster import needs_namespaces

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


def _operation_rows(output: str) -> list[str]:
    """The operation names of a table printed by ``cpu_primitives.time_and_print``, each
    checked to have a positive wall time."""
    rows = re.findall(r"^(.+?)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", output, re.MULTILINE)
    assert all(float(wall) > 0 for _, wall, _, _ in rows), output
    return [name.strip() for name, *_ in rows]


def _operation_table(stdout: str) -> dict[str, tuple[float, float, float]]:
    """Every line under the header of a table printed by ``cpu_primitives.time_and_print``:
    operation -> (wall, user, sys) milliseconds, each read as whatever number it says (so a
    nan, inf or negative time is read, not skipped)."""
    lines = stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.split()[:1] == ["operation"]), None)
    assert header is not None, f"no table in:\n{stdout}"
    assert lines[header].split()[1:] == ["wall", "ms", "user", "ms", "sys", "ms"], stdout
    table = {}
    for line in lines[header + 1 :]:
        name, *times = line.rsplit(maxsplit=3)
        assert len(times) == 3, f"expected three times in {line!r}:\n{stdout}"
        table[name.strip()] = tuple(float(t) for t in times)
    return table


def test_cpu_primitives_prints_every_operation():
    script = str(BENCHMARKS / "cpu_primitives.py")
    argv = [sys.executable, script, "--devices", "4", "--mib", "1", "--rounds", "1"]
    output = _run_process(argv).stdout
    table = _operation_table(output)
    for name, (wall, user, system) in table.items():
        assert all(math.isfinite(t) for t in (wall, user, system)), (name, output)
        assert wall > 0 and user >= 0 and system >= 0, (name, output)
        # Every call runs XLA on the devices' threads, so it costs processor time (which the
        # kernel splits into user and system by sampling: either alone may read 0.00).
        assert user + system > 0, (name, output)
    assert list(table) == [
        "psum of 1 MiB",
        "one ppermute of 1 MiB",
        "3 chained ppermutes of 1/4 MiB",
        "return 1 MiB unchanged (write the output)",
        "zero-fill a fresh 1 MiB buffer",
        "scale 1 MiB by 2 (one elementwise pass)",
        "ring reduce-scatter of 1 MiB (jaxdist)",
        "ring allreduce of 1 MiB (jaxdist)",
    ], output


def test_torus2d_phases_prints_the_schedule_and_its_phases():
    script = str(BENCHMARKS / "torus2d_phases.py")
    output = _run([sys.executable, script, "--mib", "1", "--rounds", "1"])
    assert _operation_rows(output) == [
        "pmean over both axes",
        "ring mean over all 8",
        "torus2d mean, (y, x): inner axis of 2",
        "torus2d mean, (x, y): inner axis of 4",
        "three phases in turn, (y, x)",
        "phase 1: reduce-scatter over x, 1 -> 0.5 MiB",
        "phase 2: ring mean over y of 0.5 MiB",
        "phase 3: all-gather over x, 0.5 -> 1 MiB",
        "swap of a 0.5 MiB buffer",
        "swap of the 0.5 MiB half of a buffer",
        "add two 0.5 MiB halves",
        "concatenate a 0.5 MiB buffer and its double",
    ], output


@pytest.mark.multiprocess
def test_exchange_pieces_checks_its_data_across_processes(tmp_path):
    args = ["--mib", "1", "--pieces", "none,256K,100000", "--iters", "1"]
    result = _launched_json(tmp_path, 2, "exchange_pieces.py", args)
    assert result["devices"] == 2 and result["mib"] == 1
    assert [row["piece"] for row in result["rows"]] == ["none", "256K", "100000"]
    assert all(row["seconds"] > 0 for row in result["rows"]), result


@pytest.mark.multiprocess
def test_bidirectional_pieces_checks_every_variant_across_processes(tmp_path):
    args = ["--mib", "1", "--pieces", "none,64K", "--rounds", "1"]
    result = _launched_json(tmp_path, 3, "bidirectional_pieces.py", args)
    assert result["devices"] == 3
    assert [row["variant"] for row in result["rows"]] == [
        "ring",
        "bidirectional, pieces none",
        "bidirectional, pieces 64K",
    ]
    assert all(row["median_s"] > 0 for row in result["rows"]), result


@pytest.mark.multiprocess
def test_ppermute_patterns_across_processes(tmp_path):
    result = _launched_json(tmp_path, 2, "ppermute_patterns.py", ["--sizes", "4K", "--iters", "1"])
    assert result["devices"] == 2 and result["processes"] == 2
    names = {row["pattern"] for row in result["rows"]}
    assert {"shift", "swap1", "shift_x4", "compute", "psum"} <= names, names


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_ring_timeline_run_under_strace_and_analyze(tmp_path):
    """The documented pipeline: the ring under strace on process 0, then the per-step gaps."""
    trace = tmp_path / "ring.strace"
    script = str(BENCHMARKS / "ring_timeline.py")
    run = f"{sys.executable} {script} run --mib 1 --iters 2"
    shell = (
        f'if [ "$JAXDIST_PROCESS_ID" = 0 ]; then exec strace -f -ttt '
        f"-e trace=writev,recvfrom,write -o {trace} {run}; else exec {run}; fi"
    )
    _run(_launch(4, "sh", "-c", shell))
    # 4 devices, 1 MiB each: every ring step moves a quarter of a MiB.
    output = _run([sys.executable, script, "analyze", str(trace), "--chunk-mib", "0.25"])
    calls = [line for line in output.splitlines() if line.startswith("call ")]
    assert len(calls) == 2, output
    for line in calls:  # 3 reduce-scatter and 3 all-gather steps: a send and a receive each
        assert len(re.findall(r"\bS\d", line)) == 6 and len(re.findall(r"\bR\d", line)) == 6, line


def test_model_check_reprices_stored_results(tmp_path):
    from jaxdist.comm import cost_model

    # A result measured exactly at the one-port model's times.
    link = cost_model.Link(alpha=1e-4, beta=1e-9)
    sizes, algorithms = (2**20, 2**24), ("ring", "bidirectional_ring")
    rows = []
    for s in sizes:
        for a in algorithms:
            seconds = cost_model.predict(a, s, (8,), link)
            rows.append({"algorithm": a, "nbytes": s, "seconds": seconds,
                         "predicted_seconds": seconds})  # fmt: skip
    result = {"mesh": "ring-8", "axis_sizes": [8], "rows": rows,
              "link": {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "ports": 1}}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    script = str(BENCHMARKS / "model_check.py")
    output = _run([sys.executable, script, str(path), "--ports", "1,2"])
    assert "warning" not in output, output
    cells = {
        (name, int(ports)): [float(c) for c in rest.split()]
        for name, ports, rest in re.findall(r"^(\w+)\s+(\d)\s+([\d. ]+)$", output, re.M)
    }
    assert cells[("ring", 1)] == cells[("ring", 2)] == [1.0, 1.0], output
    assert cells[("bidirectional_ring", 1)] == [1.0, 1.0], output
    # Two ports halve both of its terms: the same times are twice the prediction.
    assert cells[("bidirectional_ring", 2)] == [2.0, 2.0], output
    # A stored prediction that today's model does not reproduce is pointed out.
    rows[0]["predicted_seconds"] *= 1.1
    path.write_text(json.dumps(result))
    output = _run([sys.executable, script, str(path)])
    assert "# warning: today's model does not reproduce this run's own predictions for " \
        "ring at 1M (a default or a formula changed since)" in output, output  # fmt: skip
    # The stored results (written before the port count was recorded) still read.
    stored = str(BENCHMARKS / "results" / "hosts4_1gbit_in_place.json")
    assert "bidirectional_ring" in _run([sys.executable, script, stored, "--ports", "1"])
    proc = subprocess.run([sys.executable, script, str(path), "--ports", "0"],
                          env=clean_env(), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "a link needs ports >= 1" in proc.stderr, proc.stderr


def test_ps_vs_ring_plot_draws_the_stored_results(tmp_path):
    out = tmp_path / "ps_vs_ring.png"
    _run([sys.executable, str(BENCHMARKS / "ps_vs_ring.py"), "plot", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _socket_rates(script: str, output: str) -> dict[str, tuple[int, float, float, bool]]:
    """Each row host 0 printed: name -> (payload bytes, seconds, the MB/s printed, whether the
    time runs until the bytes arrived). ``one_way`` times host 0's ``sendall``, which returns
    once the last bytes are in its socket buffer, not at the receiver: no link bound holds."""
    rows = {}
    if script == "tcp_duplex.py":
        pattern = r"^\[p0\] (\w+)\s+(\d+) MB per direction:\s+(\S+) ms,\s+(\S+) MB/s per direction$"
        for name, mbytes, ms, rate in re.findall(pattern, output, re.MULTILINE):
            rows[name] = (int(mbytes) * 10**6, float(ms) / 1e3, float(rate), name != "one_way")
    else:
        pattern = (r"^\[p0\] (\d+) MiB in\s+(\d+) chained steps of \S+ MiB:\s+(\S+) ms,"
                   r"\s+(\S+) MB/s per link,\s+\S+ ms per step$")  # fmt: skip
        for mib, steps, ms, rate in re.findall(pattern, output, re.MULTILINE):
            chunk = (int(mib) << 20) // int(steps)
            rows[f"{steps} steps"] = (chunk * int(steps), float(ms) / 1e3, float(rate), True)
    return rows


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("script", "hosts", "args", "names"),
    [
        ("tcp_duplex.py", 2, ["--mbytes", "8", "--repeats", "1"],
         ["one_way", "duplex_1conn", "duplex_2conn"]),
        # 1, H - 1 and 2 (H - 1) steps on H = 4 hosts.
        ("tcp_ring.py", 4, ["--mib", "8", "--repeats", "1"], ["1 steps", "3 steps", "6 steps"]),
    ],
)  # fmt: skip
def test_plain_socket_scripts_on_the_emulated_cluster(script, hosts, args, names):
    argv = [*JAXDIST, "cluster", "--hosts", str(hosts), "--bandwidth", "1gbit", "--timeout", "120"]
    output = _run([*argv, "--", sys.executable, str(BENCHMARKS / script), *args], timeout=150)
    rows = _socket_rates(script, output)
    assert list(rows) == names, output
    # --bandwidth 1gbit: tbf passes at most burst + 125e6 * t bytes in any t seconds, headers
    # included; jaxdist cluster gives each link a bucket of 2 ms of traffic at its rate
    # (jaxdist/runtime/cluster.py). Allow 5 ms more for a sender that starts before the
    # host timing it (the hosts line up within a scheduler's delay): with 8 MB, at most
    # about 12% over the link's rate.
    rate = 10**9 / 8
    allowance = (0.002 + 0.005) * rate
    for name, (nbytes, seconds, printed, over_the_link) in rows.items():
        assert math.isfinite(printed) and printed > 0 and seconds > 0, (name, output)
        # The rate printed is the payload over the time printed (to its rounding).
        assert printed == pytest.approx(nbytes / seconds / 1e6, rel=0.01, abs=0.1), (name, output)
        if over_the_link:
            most = nbytes / ((nbytes - allowance) / rate) / 1e6
            assert printed <= most, (name, printed, most, output)


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
        assert sorted(times) == ["conv forward ms", "conv forward+backward ms",
                                 "matmul forward ms", "matmul forward+backward ms"], row  # fmt: skip
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


def test_pipeline_memory_gpipe_grows_with_micro_batches_and_1f1b_does_not(tmp_path):
    out = tmp_path / "memory.json"
    _run([sys.executable, str(BENCHMARKS / "pipeline_memory.py"), "--stages", "2",
          "--microbatches", "2,4,8", "--json", str(out)])  # fmt: skip
    rows = {(r["schedule"], r["microbatches"]): r for r in json.loads(out.read_text())}
    assert [rows["gpipe", m]["stash_slots"] for m in (2, 4, 8)] == [2, 4, 8]
    assert [rows["1f1b", m]["stash_slots"] for m in (2, 4, 8)] == [2, 2, 2]
    # The compiler's own figures: GPipe's 4 more stashed inputs (4 MiB each) from M = 4 to 8
    # show in its temporaries; 1F1B's stay as they were.
    gpipe_growth = rows["gpipe", 8]["temp_mib"] - rows["gpipe", 4]["temp_mib"]
    assert gpipe_growth >= 4 * 4 and rows["gpipe", 8]["temp_mib"] > rows["1f1b", 8]["temp_mib"]
    assert rows["1f1b", 8]["temp_mib"] == rows["1f1b", 4]["temp_mib"]


def test_pipeline_bytes_against_data_parallelism(tmp_path):
    out = tmp_path / "bytes.json"
    text = _run([sys.executable, str(BENCHMARKS / "pipeline_bytes.py"), "--microbatches", "2",
                 "--schedules", "gpipe,1f1b", "--json", str(out)])  # fmt: skip
    rows = {r["training"]: r for r in json.loads(out.read_text())["rows"]}
    assert "| data parallel, ring over 8 |" in text
    assert rows["pipeline gpipe"]["bytes_sent"] < rows["data parallel"]["bytes_sent"] / 2
    assert rows["pipeline gpipe"]["messages"] < rows["pipeline 1f1b"]["messages"]


@pytest.mark.slow
def test_hybrid_comm_times_every_route_and_variant(tmp_path):
    out = tmp_path / "hybrid.json"
    argv = [sys.executable, str(BENCHMARKS / "hybrid_comm.py"), "--model", "resnet50",
            "--per-device", "1", "--image-size", "32", "--iters", "1", "--link", "50us:1gbit",
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["path"] for r in result["layers"]] == [
        "ring allreduce", "factors: all-gather", "factors: all-gather + rebuild"
    ]  # fmt: skip
    assert [r["variant"] for r in result["steps"]] == [
        "ring", "factors for head", "auto", "no averaging"
    ]  # fmt: skip
    assert all(r["seconds"] > 0 and r["bytes_sent"] > 0 for r in result["layers"])
    ring, factors = result["steps"][0], result["steps"][1]
    assert factors["bytes_sent"] < ring["bytes_sent"] and result["flops"] > 0
    assert "layer head  2048x1000, 1 rows" in proc.stdout, proc.stdout
