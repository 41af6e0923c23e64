"""Faults injected into real runs: what the user sees (one line, an exit code), what is kept
(the newest complete checkpoint, and a rerun bit-identical to an uninterrupted run) and how
long until every process is gone. docs/training.md ("What happens when...") lists them.

The single-process cases run `jaxdist train` as its own process on 2 forced CPU devices
(signals, file-size limits and a watchdog that ends the process need one) and compare with
one uninterrupted run of the same recipe. The multi-process cases (`jaxdist launch` of 4
processes) are slow and marked so.
"""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from jaxdist.cli import main
from tests._procs import JAXDIST, REPO, clean_env, processes_with_env

RECIPE = """
from tests.test_trainer import tiny_config

def get_config():
    c = tiny_config()
    c.batch_ramp = ()
    c.batch_size = 16
    c.max_steps = 8
    c.checkpoint.every_steps = 2
    c.log_every_steps = 1
    return c
"""
LAST_STEP = 8


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "faulty.py"
    path.write_text(RECIPE)
    return path


def train_command(recipe, workdir, *sets, devices=2):
    overrides = [arg for s in sets for arg in ("--set", s)]
    return [
        *JAXDIST,
        "--cpu-devices",
        str(devices),
        "train",
        str(recipe),
        "--workdir",
        str(workdir),
        *overrides,
    ]


def train(recipe, workdir, *sets, devices=2, env=None, **kwargs):
    """Run `jaxdist train` to its end in its own process."""
    return subprocess.run(
        train_command(recipe, workdir, *sets, devices=devices),
        env=env or clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


@pytest.fixture(scope="module")
def uninterrupted(recipe, tmp_path_factory):
    """The workdir of one run of the recipe from start to end."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = train(recipe, workdir)
    assert done.returncode == 0, done.stderr
    return workdir


def saved_state(workdir, step):
    """Every array of a saved train state, by path."""
    path = epath.Path(workdir / "checkpoints" / str(step) / "state")
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(path).item_metadata  # saved on any number of processes
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), saved
        )
        tree = checkpointer.restore(path, target)
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def assert_same_as_uninterrupted(workdir, uninterrupted, step=LAST_STEP):
    got, want = saved_state(workdir, step), saved_state(uninterrupted, step)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{name} differs from the uninterrupted run"


def complete_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def one_line(stderr, *parts):
    lines = [line for line in stderr.strip().splitlines() if line.startswith("jaxdist")]
    assert len(lines) == 1, "expected one jaxdist line:\n" + stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def wait_for(predicate, proc, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.001)


def logged_steps(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    records = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return max((r["step"] for r in records if r["kind"] == "train"), default=0)


# --------------------------------------------------------------------- one process


@pytest.mark.slow  # two CLI runs: about 30 s
def test_a_rerun_on_another_device_count_is_refused_with_the_diff(recipe, uninterrupted, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    refused = train(recipe, workdir, "max_steps=10", devices=4)
    assert refused.returncode == 2, refused.stderr
    one_line(refused.stderr, "devices.mesh: 'data=2' -> 'data=4'", "--allow-config-change")
    assert complete_steps(workdir) == complete_steps(uninterrupted)


def test_a_checkpoint_of_another_model_names_the_first_mismatched_parameter(
    recipe, uninterrupted, tmp_path, capsys
):
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    recorded = (workdir / "config.json").read_text()
    code = main(
        [
            "train",
            str(recipe),
            "--workdir",
            str(workdir),
            "--set",
            "model.width=8",
            "--set",
            "max_steps=10",
            "--allow-config-change",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    line = one_line(err, f"the checkpoint at step {LAST_STEP}", "holds another model or recipe")
    assert re.search(
        r": params\.\S+ is \(\d+(, \d+)*\) there and \(\d+(, \d+)*\) in this run", line
    )
    assert complete_steps(workdir) == complete_steps(uninterrupted), "checkpoints were moved"
    assert (workdir / "config.json").read_text() == recorded, "the refused config was recorded"


def test_a_truncated_array_file_falls_back_a_step_in_two_quiet_lines(
    recipe, uninterrupted, tmp_path
):
    """The newest checkpoint's largest array file cut in half: the rerun warns that the step
    cannot be read and that it was moved aside, and says nothing else on stderr (orbax's
    abandoned reads raise as they are collected), then trains on to the same end."""
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    data = [
        p
        for p in (workdir / "checkpoints" / str(LAST_STEP) / "state").rglob("*")
        if p.is_file() and p.parent.name == "d"
    ]
    largest = max(data, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    rerun = train(recipe, workdir)
    assert rerun.returncode == 0, rerun.stderr
    lines = rerun.stderr.strip().splitlines()
    assert len(lines) == 2, (
        f"expected two warning lines, found {len(lines)}:\n{rerun.stderr[:3000]}"
    )
    assert f"checkpoint at step {LAST_STEP} in" in lines[0] and "cannot be read" in lines[0]
    assert f"moved the unreadable step {LAST_STEP}" in lines[1]
    assert f"resumed from step {LAST_STEP - 2}" in rerun.stdout
    assert_same_as_uninterrupted(workdir, uninterrupted)


@pytest.mark.beside_one
def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_step(
    recipe, uninterrupted, tmp_path
):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(recipe, workdir),
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    partial = workdir / "checkpoints" / "4.orbax-checkpoint-tmp"
    try:
        wait_for(partial.exists, proc, 240, "checkpoint write of step 4")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert partial.exists(), "the write finished before the kill; nothing was cut short"
    assert complete_steps(workdir) == [2]

    rerun = train(recipe, workdir)
    assert rerun.returncode == 0, rerun.stderr
    assert "moved an incomplete checkpoint (a save cut short)" in rerun.stderr
    assert (workdir / "checkpoints.unreadable" / partial.name).is_dir()
    assert "resumed from step 2" in rerun.stdout
    assert_same_as_uninterrupted(workdir, uninterrupted)


@pytest.mark.beside_one
@pytest.mark.slow  # a CLI run filling a small disk: about 20 s
def test_a_full_disk_during_a_save_stops_in_one_line_and_keeps_the_previous_step(
    recipe, uninterrupted, tmp_path
):
    """Once step 4 is saved, the run may write no file beyond 40 KB, as on a full disk: the
    next save fails, the run stops in one line, and the checkpoint of step 4 still resumes."""
    workdir = tmp_path / "run"
    # Compiled programs are read from the tests' cache but never written: they exceed the limit.
    env = clean_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")
    proc = subprocess.Popen(
        train_command(recipe, workdir),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        saved = workdir / "checkpoints" / "4"
        wait_for(saved.exists, proc, 240, "checkpoint of step 4")
        os.kill(proc.pid, signal.SIGSTOP)  # no write may start while the limit is set
        assert not (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").exists()
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (40_000, 40_000))
        os.kill(proc.pid, signal.SIGCONT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - start < 120
    assert proc.returncode == 1, err
    one_line(
        err,
        "cannot write the checkpoint of step 6",
        "(File too large (errno 27))",
        "step 4 is the newest complete one",
    )
    assert err.strip().count("\n") == 0, f"more than the one line:\n{err}"
    assert complete_steps(workdir) == [2, 4]

    rerun = train(recipe, workdir)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from step 4" in rerun.stdout
    assert_same_as_uninterrupted(workdir, uninterrupted)


def test_a_write_error_names_the_reason_of_its_os_error_code():
    """TensorStore's text may put a spec payload between the reason and the code; the reason
    is named from the code either way."""
    from jaxdist.run.checkpoint import _os_error

    plain = "OUT_OF_RANGE: Error writing local file: File too large [os_error_code='27']"
    spec = (
        "OUT_OF_RANGE: Error writing local file: File too large [source locations='a.cc:1'] "
        "[tensorstore_spec='{\"create\":true}'] [os_error_code='27']"
    )
    assert _os_error(RuntimeError(plain)) == "File too large (errno 27)"
    assert _os_error(RuntimeError(spec)) == "File too large (errno 27)"
    assert _os_error(RuntimeError("no code here")) == "RuntimeError: no code here"


def test_os_errors_at_start_are_one_line_and_leave_no_temporary_file(recipe, tmp_path):
    """A workdir that is a file, one under a file, and a file-size limit hit while writing
    config.json: one line each naming the path and the reason, exit 1, nothing half-written.
    (Permissions cannot be tried as root, which these tests may run as.)"""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    done = train(recipe, afile)
    assert done.returncode == 1, done.stderr
    one_line(done.stderr, f"the workdir {afile} is a file")
    done = train(recipe, afile / "run")
    assert done.returncode == 1, done.stderr
    one_line(done.stderr, f"cannot use the workdir {afile / 'run'}", "[ENOTDIR]")

    workdir = tmp_path / "limited"

    def limit_file_size():  # the lock file fits, config.json does not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    env = clean_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")
    done = train(recipe, workdir, env=env, preexec_fn=limit_file_size)
    assert done.returncode == 1, done.stderr
    one_line(done.stderr, f"cannot use the workdir {workdir}", "config.json", "[EFBIG]")
    assert not list(workdir.glob("*.tmp")), list(workdir.iterdir())


def test_a_non_finite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(
    recipe, tmp_path, capsys
):
    workdir = tmp_path / "run"
    args = [
        "train",
        str(recipe),
        "--workdir",
        str(workdir),
        "--set",
        "lr.peak=1e12",
        "--set",
        "max_steps=40",
    ]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    line = one_line(err, "the loss is nan at step", "stopped without saving it")
    bad_step = int(line.split("at step ")[1].split(";")[0])
    kept = complete_steps(workdir)
    assert all(step < bad_step for step in kept), (kept, line)
    if kept:
        assert f"the newest checkpoint, step {kept[-1]}, is kept" in line
        state = saved_state(workdir, kept[-1])
        assert all(np.isfinite(v).all() for v in state.values())
    stop = json.loads((workdir / "events.log").read_text().splitlines()[-1].split(" ", 1)[1])
    assert stop["metadata"]["status"] == "aborted"
    assert stop["metadata"]["reason"].startswith("NonFiniteError: the loss is nan")


@pytest.mark.slow  # a CLI run poisoned step by step: about 20 s
def test_skipping_non_finite_steps_stops_after_the_limit_in_a_row(recipe, tmp_path, capsys):
    workdir = tmp_path / "run"
    args = [
        "train",
        str(recipe),
        "--workdir",
        str(workdir),
        "--set",
        "lr.peak=1e12",
        "--set",
        "max_steps=40",
        "--set",
        "skip_nonfinite_steps=3",
    ]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    one_line(err, "3 steps in a row up to step", "were skipped (skip_nonfinite_steps=3)")
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert len(skipped) >= 3 and skipped[-3:] == list(range(skipped[-1] - 2, skipped[-1] + 1))
    for step in complete_steps(workdir):  # skipped steps left the model finite
        assert all(np.isfinite(v).all() for v in saved_state(workdir, step).values())


@pytest.mark.beside_one
def test_a_second_run_on_the_same_workdir_is_refused_and_the_first_finishes(
    recipe, uninterrupted, tmp_path, capsys
):
    workdir = tmp_path / "run"
    first = subprocess.Popen(
        train_command(recipe, workdir),
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: logged_steps(workdir) >= 1, first, 240, "first logged step")
        code = main(["train", str(recipe), "--workdir", str(workdir)])
        err = capsys.readouterr().err
        assert code == 1, err
        one_line(err, f"{workdir} is in use by another run (pid {first.pid} on host")
        _, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    steps = [json.loads(x)["step"] for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [*range(1, LAST_STEP + 1), LAST_STEP], "the first run's log was disturbed"
    assert_same_as_uninterrupted(workdir, uninterrupted)


# ------------------------------------------------------------- data on disk goes bad

DATA_SETS = (
    "data.source=folder",
    "data.num_classes=2",
    "data.image_size=16",
    "eval_batch_size=8",
    "batch_size=8",
)


@pytest.fixture
def images(tmp_path):
    root = tmp_path / "images"
    main(
        [
            "data",
            "fake",
            str(root),
            "--classes",
            "2",
            "--train-per-class",
            "8",
            "--val-per-class",
            "4",
            "--min-size",
            "20",
            "--max-size",
            "24",
        ]
    )
    return root


@pytest.mark.slow  # a recipe run on files on disk: about 40 s
def test_a_data_file_deleted_mid_run_stops_at_a_checkpoint_naming_it(
    recipe, images, tmp_path, capsys
):
    sets = [f"data.root={images}", *DATA_SETS, "num_epochs=20.0", "max_steps=12"]
    reference = tmp_path / "reference"
    assert (
        main(
            [
                "train",
                str(recipe),
                "--workdir",
                str(reference),
                *[a for s in sets for a in ("--set", s)],
            ]
        )
        == 0
    )
    backup = tmp_path / "backup"
    shutil.copytree(images, backup)
    workdir = tmp_path / "run"

    def delete_the_images_after_step_3():
        while logged_steps(workdir) < 3:
            time.sleep(0.01)
        for path in (images / "train").rglob("*.JPEG"):
            path.unlink()

    deleter = threading.Thread(target=delete_the_images_after_step_3, daemon=True)
    deleter.start()
    capsys.readouterr()
    code = main(
        ["train", str(recipe), "--workdir", str(workdir), *[a for s in sets for a in ("--set", s)]]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    line = one_line(err, f"cannot read {images}/train/", "No such file", "the run stopped at step")
    stopped = int(line.split("the run stopped at step ")[1].split(" ")[0])
    assert complete_steps(workdir)[-1] == stopped, "no checkpoint where the run stopped"
    assert f"the newest checkpoint, step {stopped}, is kept" in line

    shutil.rmtree(images)
    shutil.copytree(backup, images)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                str(recipe),
                "--workdir",
                str(workdir),
                *[a for s in sets for a in ("--set", s)],
            ]
        )
        == 0
    )
    assert f"resumed from step {stopped}" in capsys.readouterr().out
    assert_same_as_uninterrupted(workdir, reference, step=12)


@pytest.mark.beside_one
@pytest.mark.slow  # a CLI run left to stall: about 20 s
def test_a_stuck_input_reader_is_reported_by_the_watchdog(recipe, images, tmp_path):
    """The images become FIFOs that nobody writes: reading one blocks forever, as on a hung
    network filesystem. The watchdog names the process, the step and the wait."""
    workdir = tmp_path / "run"
    sets = [f"data.root={images}", *DATA_SETS, "num_epochs=200.0", "max_steps=400", "watchdog_s=3"]
    proc = subprocess.Popen(
        train_command(recipe, workdir, *sets),
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: logged_steps(workdir) >= 2, proc, 240, "second logged step")
        for path in (images / "train").rglob("*.JPEG"):
            path.unlink()
            os.mkfifo(path)
        stuck_since = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 124, err
    one_line(
        err,
        "process 0 of 1 has been reading the input batch of step",
        "(watchdog_s=3)",
        f"{workdir}/stuck-p0.txt",
    )
    assert time.monotonic() - stuck_since < 30
    stacks = (workdir / "stuck-p0.txt").read_text()
    assert "reading the input batch of step" in stacks and "read_bytes" in stacks


# ------------------------------------------------------------------ several processes


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_missing_peer_or_coordinator_is_one_line_within_the_timeout(recipe, process_id):
    """Process 0 alone (the count never fills) or process 1 alone (nobody answers at the
    coordinator address): one line after JAXDIST_TIMEOUT, not a hang."""
    from jaxdist.runtime import launch

    coordinator = f"127.0.0.1:{launch.free_port()}"
    env = clean_env(
        JAXDIST_COORDINATOR=coordinator,
        JAXDIST_NUM_PROCESSES="2",
        JAXDIST_PROCESS_ID=str(process_id),
        JAXDIST_TIMEOUT="3",
    )
    start = time.monotonic()
    proc = subprocess.run(
        [*JAXDIST, "train", str(recipe)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert (
        f"process {process_id} of 2 (from jaxdist-env) has waited 3 s for all processes to join at coordinator {coordinator}"
        in proc.stderr
    ), proc.stderr[-2000:]
    assert elapsed < 45, f"expected to give up soon after the 3 s timeout, took {elapsed:.1f} s"


DISAGREEING_RECIPE = RECIPE.replace(
    "    return c",
    "    import os\n"
    "    if os.environ.get('JAXDIST_PROCESS_ID') == '1':\n"
    "        c.optimizer.weight_decay = 1e-3\n"
    "    return c",
)


@pytest.mark.multiprocess
def test_processes_given_different_configs_stop_before_training(tmp_path):
    """Two processes of one run, one with another weight decay: both stop in one line
    naming the key and the process, exit 2, nothing trained or saved."""
    recipe = tmp_path / "disagree.py"
    recipe.write_text(DISAGREEING_RECIPE)
    workdir = tmp_path / "run"
    done = subprocess.run(
        [
            *JAXDIST,
            "launch",
            "--processes",
            "2",
            "--devices-per-process",
            "1",
            "--",
            *JAXDIST,
            "train",
            str(recipe),
            "--workdir",
            str(workdir),
        ],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout[-3000:]
    refusals = [line for line in done.stdout.splitlines() if "differ from process 0" in line]
    assert len(refusals) == 2, done.stdout[-3000:]  # one line from each process
    assert all("process 1: config.optimizer.weight_decay" in line for line in refusals)
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


MULTI_RECIPE = RECIPE.replace("c.max_steps = 8", "c.max_steps = 24")


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """The multi-process recipe, and the workdir of its uninterrupted run on 4 processes."""
    recipe = tmp_path_factory.mktemp("multi") / "multi.py"
    recipe.write_text(MULTI_RECIPE)
    workdir = recipe.parent / "uninterrupted"
    done = subprocess.run(
        launch_command(recipe, workdir),
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return recipe, workdir


def launch_command(recipe, workdir):
    return [
        *JAXDIST,
        "launch",
        "--processes",
        "4",
        "--devices-per-process",
        "1",
        "--",
        *JAXDIST,
        "train",
        str(recipe),
        "--workdir",
        str(workdir),
    ]


def assert_resumes_like_uninterrupted(recipe, workdir, uninterrupted, last_step=24):
    rerun = subprocess.run(
        launch_command(recipe, workdir),
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert_same_as_uninterrupted(workdir, uninterrupted, step=last_step)
    return rerun.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_of_one_of_4_processes_stops_the_others_within_60s(four_processes, tmp_path):
    recipe, uninterrupted = four_processes
    workdir = tmp_path / "run"
    token = f"jaxdist-fault-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        launch_command(recipe, workdir),
        env=clean_env(FAULT_TOKEN=token),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: 4 in complete_steps_or_none(workdir), proc, 300, "checkpoint of step 4")
        victim = next(
            pid
            for pid in processes_with_env(token)
            if b"JAXDIST_PROCESS_ID=2\0" in Path(f"/proc/{pid}/environ").read_bytes()
        )
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137, output[-3000:]
    assert "process 2 exited with code 137; stopping the others" in output
    assert elapsed < 60, f"the others took {elapsed:.0f} s to stop"
    assert processes_with_env(token) == [], "processes survived"
    assert_resumes_like_uninterrupted(recipe, workdir, uninterrupted)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_4_processes_saves_one_step_everywhere_and_resumes(four_processes, tmp_path):
    recipe, uninterrupted = four_processes
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        launch_command(recipe, workdir),
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: logged_steps(workdir) >= 3, proc, 300, "third logged step")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output[-3000:]
    stopped = [
        int(m) for m in re.findall(r"stopped by SIGTERM at step (\d+); checkpoint saved", output)
    ]
    assert len(stopped) == 4 and len(set(stopped)) == 1, output[-3000:]
    assert complete_steps(workdir)[-1] == stopped[0] < 24
    output = assert_resumes_like_uninterrupted(recipe, workdir, uninterrupted)
    assert f"resumed from step {stopped[0]}" in output


def complete_steps_or_none(workdir):
    return complete_steps(workdir) if (workdir / "checkpoints").is_dir() else []
