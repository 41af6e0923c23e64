"""The local launcher: labelled output, exit codes, and no survivors after a failure."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from jaxdist.cli.launch import command_after_dashes
from jaxdist.runtime import distributed, launch
from tests._procs import JAXDIST, REPO, WORKER, clean_env, processes_with_env

PY = sys.executable


def test_local_workers_set_the_process_group_variables():
    workers = launch.local_workers(["echo"], 3, devices_per_process=2)
    coordinators = {w.env[distributed.ENV_COORDINATOR] for w in workers}
    assert len(coordinators) == 1, f"expected one coordinator for all, found {coordinators}"
    assert next(iter(coordinators)).startswith("127.0.0.1:")
    found = [
        (
            w.env[distributed.ENV_PROCESS_ID],
            w.env[distributed.ENV_NUM_PROCESSES],
            w.env[distributed.ENV_LOCAL_DEVICES],
        )
        for w in workers
    ]
    assert found == [("0", "3", "2"), ("1", "3", "2"), ("2", "3", "2")]
    assert {w.env[distributed.ENV_LAUNCHER] for w in workers} == {"jaxdist launch"}


def test_local_workers_reject_bad_counts():
    with pytest.raises(ValueError, match="--processes must be >= 1"):
        launch.local_workers(["echo"], 0)
    with pytest.raises(ValueError, match="--devices-per-process must be >= 1"):
        launch.local_workers(["echo"], 2, devices_per_process=0)


def test_command_after_dashes():
    assert command_after_dashes(["--", "python", "-c", "1"]) == ["python", "-c", "1"]
    assert command_after_dashes(["python", "--", "x"]) == ["python", "--", "x"]


def test_detect_reads_jaxdist_env(monkeypatch):
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "3")
    monkeypatch.setenv(distributed.ENV_LOCAL_DEVICES, "2")
    group = distributed.detect()
    assert group == distributed.ProcessGroup("jaxdist-env", "10.0.0.1:1234", 4, 3, 2)
    assert group.is_multiprocess
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "4")
    with pytest.raises(distributed.DistributedInitError, match="process_id=4, num_processes=4"):
        distributed.detect()
    monkeypatch.delenv(distributed.ENV_COORDINATOR)
    with pytest.raises(distributed.DistributedInitError, match="missing: JAXDIST_COORDINATOR"):
        distributed.detect()


def test_describe_names_how_the_processes_found_each_other(monkeypatch):
    describe, group = distributed.describe, distributed.ProcessGroup
    assert describe(group("none", local_device_count=2)) == "single process"
    assert (
        describe(group("slurm", "node1:63201", 4, 0))
        == "SLURM: 4 processes, coordinator node1:63201"
    )
    assert describe(group("ompi", "10.0.0.1:61440", 2, 1)) == (
        "Open MPI: 2 processes, coordinator 10.0.0.1:61440"
    )
    # JAXDIST_* variables name their launcher; set by hand, they name themselves.
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:41234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    assert describe(distributed.detect()) == (
        "JAXDIST_* variables: 2 processes, coordinator 127.0.0.1:41234"
    )
    monkeypatch.setenv(distributed.ENV_LAUNCHER, "jaxdist launch")
    assert describe(distributed.detect()) == (
        "jaxdist launch: 2 processes, coordinator 127.0.0.1:41234"
    )


def _clear_process_group_env(monkeypatch):
    """Remove every variable detect() reads, so the test sees a plain single machine."""
    for name in (*distributed.JAXDIST_ENV, distributed.ENV_LOCAL_DEVICES):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "TPU_")) or name == "KUBERNETES_SERVICE_HOST":
            monkeypatch.delenv(name)


def test_detect_single_process_and_slurm(monkeypatch):
    _clear_process_group_env(monkeypatch)
    assert not distributed.detect().is_multiprocess
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_NODES": "2",
    }
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    group = distributed.detect()
    assert (group.source, group.num_processes, group.is_multiprocess) == ("slurm", 2, True)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not distributed.detect().is_multiprocess


def fake_pci_bus(root, devices):
    """A sysfs ``/sys/bus/pci/devices`` tree of ``(vendor, device)`` ids."""
    for i, (vendor, device) in enumerate(devices):
        slot = root / f"0000:00:{i:02x}.0"
        slot.mkdir(parents=True)
        (slot / "vendor").write_text(vendor + "\n")
        (slot / "device").write_text(device + "\n")
    return str(root)


def test_tpu_chips_are_counted_on_the_pci_bus(tmp_path):
    bus = fake_pci_bus(
        tmp_path / "pci",
        [("0x1ae0", "0x0063")] * 4
        + [("0x1ae0", "0x9999"), ("0x10de", "0x0063"), ("0x8086", "0x1")],
    )
    assert distributed._cloud_tpu_chips(bus) == 4  # Google's v5e chips, not its other devices
    assert distributed._cloud_tpu_chips(str(tmp_path / "no-sysfs")) == 0


def test_detect_a_cloud_tpu_vm_by_its_chips(monkeypatch):
    _clear_process_group_env(monkeypatch)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(distributed, "_cloud_tpu_chips", lambda: 4)
    # Chips on the PCI bus: JAX is left to ask the metadata server for the workers.
    group = distributed.detect()
    assert (group.source, group.num_processes, group.is_multiprocess) == ("tpu-vm", None, True)
    # Not for a dry run on CPU: forced CPU devices, or JAX told to use the CPU only.
    assert distributed.detect(local_device_count=8).source == "none"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert distributed.detect().source == "none"
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert distributed.detect().source == "tpu-vm"
    # Nor where the runtime was told there is no metadata server.
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    assert distributed.detect().source == "none"
    # GKE names the workers itself.
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1,w2,w3")
    assert distributed.detect() == distributed.ProcessGroup("tpu", num_processes=4)


def test_supervise_labels_output_and_returns_zero():
    out, log = io.StringIO(), io.StringIO()
    workers = [
        launch.Worker([PY, "-c", f"print('hello from {i}'); print('bye')"]) for i in range(3)
    ]
    assert launch.supervise(workers, out=out, log=log) == 0
    lines = sorted(out.getvalue().splitlines())
    expected = sorted(
        [f"[p{i}] hello from {i}" for i in range(3)] + [f"[p{i}] bye" for i in range(3)]
    )
    assert lines == expected


def test_a_program_that_cannot_be_found_is_one_line_and_exit_127(tmp_path):
    log = io.StringIO()
    workers = [
        launch.Worker([PY, "-c", "import time; time.sleep(60)"]),
        launch.Worker(["/nonexistent/cmd", "--flag"]),
    ]
    start = time.monotonic()
    assert launch.supervise(workers, grace_s=1, out=io.StringIO(), log=log) == 127
    assert time.monotonic() - start < 10, "the worker already started was not stopped"
    assert log.getvalue() == "jaxdist: cannot run '/nonexistent/cmd': not found\n"
    # Through the command line: one line on stderr, no traceback.
    proc = subprocess.run(
        [*JAXDIST, "launch", "--processes", "1", "--", "no-such-program-here"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 127, proc.stderr
    assert "cannot run 'no-such-program-here': not found" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_bare_program_is_found_beside_this_python(tmp_path):
    """``.venv/bin/jaxdist launch -- jaxdist ...`` with the venv not on PATH."""
    here = os.path.dirname(sys.executable)
    worker = launch.Worker(["jaxdist", "--help"], dict(os.environ, PATH=str(tmp_path)))
    assert launch._resolve_program(worker) == [os.path.join(here, "jaxdist"), "--help"]
    out = io.StringIO()
    assert launch.supervise([worker], out=out, log=io.StringIO()) == 0
    assert "[p0] usage: jaxdist" in out.getvalue()


def test_supervise_stops_the_others_on_failure():
    token = f"JAXDIST_TEST_TOKEN={uuid.uuid4().hex}"
    env = dict(os.environ, JAXDIST_TEST_TOKEN=token.split("=")[1])
    # Worker 1 also leaves a child in its process group: it must die with the group.
    sleeper = f"import subprocess,time; subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    workers = [
        launch.Worker([PY, "-c", "import time; time.sleep(60)"], env),
        launch.Worker([PY, "-c", sleeper], env),
        launch.Worker([PY, "-c", "import sys, time; time.sleep(1); sys.exit(3)"], env),
    ]
    start = time.monotonic()
    log = io.StringIO()
    code = launch.supervise(workers, grace_s=2, out=io.StringIO(), log=log)
    elapsed = time.monotonic() - start
    assert code == 3, f"expected the failing worker's exit code 3, found {code}"
    assert elapsed < 10, (
        f"expected the others stopped within the grace period, took {elapsed:.1f} s"
    )
    assert "process 2 exited with code 3" in log.getvalue()
    assert processes_with_env(token) == [], "processes survived the launcher"


def test_supervise_timeout_exits_124():
    workers = [launch.Worker([PY, "-c", "import time; time.sleep(60)"])]
    start = time.monotonic()
    assert (
        launch.supervise(workers, timeout_s=1, grace_s=1, out=io.StringIO(), log=io.StringIO())
        == 124
    )
    assert time.monotonic() - start < 10


def test_ctrl_c_stops_all(tmp_path):
    token = uuid.uuid4().hex
    env = clean_env(JAXDIST_TEST_TOKEN=token)
    proc = subprocess.Popen(
        [
            *JAXDIST,
            "launch",
            "--processes",
            "2",
            "--grace",
            "2",
            "--",
            PY,
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # wait until both workers run
        seen.append(line)
        if sum("up" in s for s in seen) == 2:
            break
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=30)
    rest = proc.stdout.read()
    assert code == 130, f"expected exit 130 after Ctrl-C, found {code}: {''.join(seen) + rest}"
    assert "received SIGINT" in rest
    assert processes_with_env(token) == [], "workers survived Ctrl-C"


# Beside other tests: the processes only join and sleep, and the limits are a minute.
def test_killed_jax_process_fails_the_launch_within_60s(tmp_path):
    """Two JAX processes in one run; SIGKILL one mid-run: non-zero exit, nothing left."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = clean_env(JAXDIST_TEST_PID_DIR=str(pid_dir))
    proc = subprocess.Popen(
        [*JAXDIST, "launch", "--processes", "2", "--timeout", "120", "--", PY, WORKER, "hang"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert proc.poll() is None, f"launch ended early: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the two JAX processes did not start in 60 s"
            time.sleep(0.2)
        victim = int((pid_dir / "1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    assert code != 0, f"expected a non-zero exit after a process was killed, found 0:\n{output}"
    assert "process 1 exited with code 137" in output, output
    assert elapsed < 60, f"expected exit within 60 s, took {elapsed:.1f} s"
    assert processes_with_env(str(pid_dir)) == [], "processes survived the failed launch"


@pytest.mark.multiprocess
def test_processes_join_by_command_line_flags():
    """Started by hand, without `launch`: --coordinator, --num-processes and --process-id."""
    coordinator = f"127.0.0.1:{launch.free_port()}"
    flags = ["--cpu-devices", "1", "--coordinator", coordinator, "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [*JAXDIST, *flags, "--process-id", str(i), "mesh", "show", "ring-2"],
            env=clean_env(JAXDIST_TIMEOUT="60"),
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
        # One device in each process: the ring's two devices sit on hosts 0 and 1.
        assert "fits: uses 2 of 2 cpu device(s)" in out and "[0]" in out and "[1]" in out, out


def test_process_group_flags_reach_initialize_or_are_refused(monkeypatch, capsys):
    from jaxdist.cli import main

    seen = []
    monkeypatch.setattr(
        distributed,
        "initialize",
        lambda *a, **k: seen.append((a, k)) or distributed.ProcessGroup("none"),
    )
    monkeypatch.setattr(sys.modules["jaxdist.cli"], "force_cpu_devices", lambda n: None)
    flags = ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"]
    assert main(["--cpu-devices", "2", *flags, "mesh", "list"]) == 0
    assert seen == [(("h:1", 2, 1), {"local_device_count": 2})]
    # The flags win over the variables `jaxdist launch` sets, and say so.
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "elsewhere:2")
    assert main([*flags, "mesh", "list"]) == 0
    assert seen[-1] == (("h:1", 2, 1), {"local_device_count": None})
    assert "jaxdist: the flags override JAXDIST_COORDINATOR" in capsys.readouterr().err
    monkeypatch.undo()
    # Half a process group is refused, naming the flags that are missing.
    assert main(["--coordinator", "h:1", "mesh", "list"]) == 2
    assert "missing: --num-processes, --process-id" in capsys.readouterr().err
    # launch and cluster connect the processes they start; the flags have no place there.
    assert main(["--process-id", "1", "launch", "--processes", "2", "--", "true"]) == 2
    assert "--process-id: this command does not join a run" in capsys.readouterr().err


def test_tpu_chips_without_a_pod_slice_run_as_one_process(monkeypatch, capsys):
    """JAX finds no TPU workers around the chips: one process, as plain JAX would run."""
    import jax

    def no_cluster(**kwargs):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(distributed, "detect", lambda *a: distributed.ProcessGroup("tpu-vm"))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # leave this process's JAX be
    group = distributed.initialize()
    assert group == distributed.ProcessGroup("none")
    assert "TPU chips found but no TPU pod slice" in capsys.readouterr().err
    # Anywhere else the same failure is an error that names the process and the coordinator.
    monkeypatch.setattr(
        distributed, "detect", lambda *a: distributed.ProcessGroup("slurm", num_processes=2)
    )
    with pytest.raises(distributed.DistributedInitError) as caught:
        distributed.initialize()
    message = str(caught.value)
    assert message.startswith("process ? of 2 (from slurm) failed to join at coordinator (auto)")
    assert "coordinator_address should be defined. Check" in message  # one period, no prefix


def test_joining_after_the_backend_started_is_one_line(monkeypatch):
    """This test process already runs JAX's CPU backend: JAX's own refusals become one line."""
    import jax

    assert jax.device_count() == 8
    with pytest.raises(distributed.DistributedInitError, match="must run before JAX starts"):
        distributed.initialize(local_device_count=4)
    assert jax.config.jax_num_cpu_devices != 4  # refused before anything changed
    _clear_process_group_env(monkeypatch)
    monkeypatch.setattr(distributed, "_configure_cpu_collectives", lambda *a: None)
    with pytest.raises(distributed.DistributedInitError, match="must run before JAX starts"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=1)


def test_a_collective_that_lost_its_peer_is_one_line_and_any_other_error_is_kept():
    from jaxdist.runtime import distributed

    gone = RuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read "
        "error [127.0.0.1]:9625: Connection reset by peer\nmore lines"
    )
    lost = distributed.peer_lost(gone, process_count=2)
    assert lost.exit_code == 1 and "\n" not in str(lost)
    assert str(lost).startswith("another process of the run is gone (UNKNOWN: Gloo all-reduce")
    assert "rerun the same command to resume" in str(lost)
    assert distributed.peer_lost(gone, process_count=1) is None  # alone, it is no peer's fault
    assert distributed.peer_lost(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), 2) is None


QUIET_PEER = """
import logging, os, sys
from jaxdist.runtime.peer_output import quiet_peers
quiet_peers(int(sys.argv[1]), 2)
os.write(1, b"[Gloo] Rank 1 is connected to 1 peer ranks\\n")  # as gloo's C++ writes it
print("python's own line", flush=True)
logging.getLogger("absl").warning("Reached preemption sync point, step=3")
logging.getLogger("absl").warning("an orbax warning")
logging.getLogger("absl").error("an orbax error")
os.write(2, b"a native error\\n")
print("the last line, not flushed")
os._exit(0)  # as a watchdog ends a process: unbuffered (jaxdist launch), nothing is lost
"""


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_process_of_a_run_prints_only_its_own_lines(process_id):
    """Native writes to standard output (gloo's connection lines) are dropped and Python's
    kept; orbax's preemption line is dropped everywhere, other absl warnings on processes
    other than 0; errors are never dropped."""
    logging_setup = "import logging; logging.basicConfig()\n"
    done = subprocess.run(
        [PY, "-c", logging_setup + QUIET_PEER, str(process_id)],
        env=clean_env(PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "python's own line\nthe last line, not flushed\n"
    warnings = ["WARNING:absl:an orbax warning"] if process_id == 0 else []
    assert done.stderr.splitlines() == [*warnings, "ERROR:absl:an orbax error", "a native error"]
