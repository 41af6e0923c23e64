"""The scripts in ``benchmarks/`` that the docs cite still run, at sizes small enough for CI.

Their numbers are not checked (timing is not a test); what is checked is that each script
completes, prints or writes the rows the docs quote, and, where a script verifies its own
results (exchange_pieces.py compares every piece size's data), that the check passes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests._procs import JAXDIST, REPO, clean_env
from tests.test_cluster import needs_namespaces

BENCHMARKS = REPO / "benchmarks"


def _run(argv: list[str], timeout: int = 240) -> str:
    proc = subprocess.run(
        argv, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"expected exit 0 from {argv}, found {proc.returncode}:\n{output}"
    return output


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


def test_cpu_primitives_prints_every_operation():
    script = str(BENCHMARKS / "cpu_primitives.py")
    output = _run([sys.executable, script, "--devices", "4", "--mib", "1", "--rounds", "1"])
    assert _operation_rows(output) == [
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


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("script", "hosts", "args"),
    [
        ("tcp_duplex.py", 2, ["--mbytes", "1", "--repeats", "1"]),
        ("tcp_ring.py", 4, ["--mib", "1", "--repeats", "1"]),
    ],
)
def test_plain_socket_scripts_on_the_emulated_cluster(script, hosts, args):
    argv = [*JAXDIST, "cluster", "--hosts", str(hosts), "--bandwidth", "1gbit", "--timeout", "120"]
    output = _run([*argv, "--", sys.executable, str(BENCHMARKS / script), *args], timeout=150)
    assert "MB/s" in output, output


@pytest.mark.slow
def test_conv1x1_compares_every_layer(tmp_path):
    out = tmp_path / "conv.json"
    script = str(BENCHMARKS / "conv1x1.py")
    _run([sys.executable, script, "--batch", "1", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text()), "expected conv1x1.py to write its table"


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
