"""The emulated cluster: namespaces come up, an allreduce runs across the hosts, all goes away.

Tests that build namespaces need root and a kernel that allows ``ip netns add``; elsewhere they
skip and say why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from jaxdist.comm import emulated_link
from jaxdist.comm.collectives import ALGORITHMS
from jaxdist.runtime import cluster
from tests._procs import JAXDIST, REPO, WORKER, clean_env, processes_with_env


def _namespace_problem() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    try:
        cluster.check_tools()
    except cluster.ClusterError as err:
        return str(err)
    name = f"{cluster.PREFIX}probe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` refused: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_PROBLEM = _namespace_problem() if sys.platform == "linux" else "not Linux"
needs_namespaces = pytest.mark.skipif(
    _PROBLEM is not None, reason=f"cannot create network namespaces here: {_PROBLEM}"
)


def _run_names(output: str) -> str:
    m = re.search(rf"({cluster.PREFIX}[0-9a-f]{{4}})-h0", output)
    assert m, f"expected the cluster to announce its hosts, found:\n{output}"
    return m.group(1)


def _assert_gone(run: str) -> None:
    names, folders = cluster.leftovers(run)
    assert (names, folders) == ([], []), f"expected no leftovers of {run}, found {names} {folders}"


def test_rate_bits_and_latency():
    assert emulated_link.rate_bits("1gbit") == 10**9
    assert emulated_link.rate_bits("100mbit") == 10**8
    assert emulated_link.rate_bits("2.5Gbit") == 2_500_000_000
    # One reading of rates for the cluster and the cost model: bytes work too.
    assert emulated_link.rate_bits("12.5GB/s") == 10**11
    assert emulated_link.parse_latency("100us") == pytest.approx(1e-4)
    assert emulated_link.parse_latency("2ms") == pytest.approx(2e-3)
    assert emulated_link.parse_latency("0") == 0
    with pytest.raises(ValueError, match=r"a rate is a number and a unit, e\.g\. 1gbit"):
        emulated_link.rate_bits("fast")
    with pytest.raises(ValueError, match="latency must look like"):
        emulated_link.parse_latency("100")


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.PrivilegeError, match=r"needs root .* running as uid 1000"):
        cluster.check_tools()


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    # Two hosts carry the same checks at half the processes; four also check a 2x2 grid whose
    # inner axis crosses hosts (tests/multiprocess_worker.py).
    "hosts",
    [2, pytest.param(4, marks=pytest.mark.slow)],
)
def test_hosts_allreduce_and_teardown(hosts):
    argv = [
        *JAXDIST,
        "cluster",
        "--hosts",
        str(hosts),
        "--bandwidth",
        "1gbit",
        "--timeout",
        "150",
        "--",
        sys.executable,
        WORKER,
        "host",
        "allreduce",
    ]
    proc = subprocess.run(
        argv, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=170
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"expected exit 0, found {proc.returncode}:\n{output}"
    run = _run_names(output)
    for p in range(hosts):
        assert f"[p{p}] CHECK host OK {run}-h{p} 10.213.0.{p + 1}" in output, output
        for algorithm in ALGORITHMS:
            assert f"[p{p}] CHECK allreduce {algorithm} {hosts}x1 OK" in output, output
    _assert_gone(run)


@needs_namespaces
def test_failing_command_tears_down_and_exits_with_its_code():
    proc = subprocess.run(
        [
            *JAXDIST,
            "cluster",
            "--hosts",
            "2",
            "--",
            "sh",
            "-c",
            'test "$JAXDIST_PROCESS_ID" = 0 || exit 7; sleep 30',
        ],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 7, (
        f"expected host 1's exit code 7, found {proc.returncode}:\n{output}"
    )
    _assert_gone(_run_names(output))


@needs_namespaces
def test_sigterm_tears_down():
    token = uuid.uuid4().hex
    proc = subprocess.Popen(
        [*JAXDIST, "cluster", "--hosts", "2", "--grace", "2", "--", "sleep", "60"],
        env=clean_env(JAXDIST_TEST_TOKEN=token),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    announced = proc.stdout.readline()
    run = _run_names(announced)
    deadline = time.monotonic() + 30
    while len(processes_with_env(token)) < 3:  # the supervisor and two sleeps
        assert time.monotonic() < deadline, "the cluster's processes did not start"
        time.sleep(0.1)
    assert cluster.leftovers(run)[0], "expected the namespaces to exist while running"
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    assert code == 128 + signal.SIGTERM, f"expected exit 143, found {code}: {proc.stdout.read()}"
    _assert_gone(run)
    assert processes_with_env(token) == [], "processes survived the cluster"


@needs_namespaces
def test_latency_needs_netem_or_says_so():
    c = cluster.EmulatedCluster(2, bandwidth="1gbit", latency="100us")
    try:
        c.create()
    except cluster.ClusterError as err:
        assert "--latency 0" in str(err), f"expected a hint to pass --latency 0, found: {err}"
    else:
        shown = subprocess.run(
            ["tc", "-n", c.host_names[0], "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "netem" in shown and "tbf" in shown, f"expected tbf + netem on eth0, found {shown}"
    finally:
        assert c.destroy() == []
    _assert_gone(f"{cluster.PREFIX}{c.run_id}")


@needs_namespaces
def test_cleanup_removes_leftovers():
    name = f"{cluster.PREFIX}{uuid.uuid4().hex[:4]}-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    made_etc = not cluster.NETNS_ETC.exists()
    (cluster.NETNS_ETC / name).mkdir(parents=True)
    (cluster.NETNS_ETC / name / "hosts").write_text("10.213.0.1 x\n")
    try:
        removed = cluster.cleanup()
        assert f"netns {name}" in removed and str(cluster.NETNS_ETC / name) in removed, removed
        _assert_gone(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(cluster.NETNS_ETC / name, ignore_errors=True)
        if made_etc:
            cluster.NETNS_ETC.rmdir()
