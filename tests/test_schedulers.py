"""`jaxdist train` under the schedulers users have: SLURM (srun, sbatch) and Open MPI (mpirun).

The processes find each other from the scheduler's environment alone (no ``JAXDIST_*``
variable, no ``jaxdist launch``), and must train exactly what ``jaxdist launch`` trains: the
same parameters, bit for bit. SLURM runs for real: ``tools/slurm/local-slurm`` starts munged,
slurmctld and slurmd on this machine (one node, everything in a temporary folder) and stops
them at the end. A machine without the Debian packages (slurm-wlm, munge, openmpi-bin) skips
these tests, naming what is missing.

In the default run (2 processes x 2 CPU devices of a tiny recipe, about 80 s): srun and mpirun
train like ``jaxdist launch``, process 0 alone prints the run's lines, and a mesh that does not
match the processes is one line. Marked slow (``-m slow``): preemption and requeue of
``examples/jaxdist.sbatch``, a task killed under srun and under mpirun, and the MNIST recipe
and the transformer LM on 4 processes x 2 devices under srun and mpirun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._procs import JAXDIST, REPO, clean_env, processes_with_env
from tests.test_faults import LAST_STEP, RECIPE, logged_steps, saved_state  # the same 8 steps

pytestmark = pytest.mark.multiprocess

LOCAL_SLURM = REPO / "tools" / "slurm" / "local-slurm"
SBATCH_SCRIPT = REPO / "examples" / "jaxdist.sbatch"
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol")
# Debian installs the daemons in /usr/sbin, which a user's PATH may lack.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])

DEVICES = 2  # CPU devices per process
PROCESSES = 2
TIMEOUT = 300


def missing(programs: tuple[str, ...]) -> list[str]:
    return [p for p in programs if shutil.which(p, path=SBIN_PATH) is None]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster of this machine: the environment its commands need."""
    absent = missing(SLURM_PROGRAMS)
    if absent:
        pytest.skip(
            f"SLURM not installed ({', '.join(absent)} not found; Debian/Ubuntu: "
            "apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        pytest.skip("tools/slurm/local-slurm starts slurmd, which needs root")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "PATH": SBIN_PATH}
    started = subprocess.run(
        [str(LOCAL_SLURM), "start", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    try:
        yield {"SLURM_CONF": str(folder / "slurm.conf"), "PATH": SBIN_PATH}
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop", str(folder)], env=env, timeout=120)


@pytest.fixture(scope="module")
def mpirun():
    """mpirun's command line up to the program: oversubscribing the cores, as root if so."""
    if missing(("mpirun",)):
        pytest.skip(
            "Open MPI not installed (mpirun not found; Debian/Ubuntu: apt-get install openmpi-bin)"
        )
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", *root, "--oversubscribe"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "tiny.py"
    path.write_text(RECIPE)
    return path


def train_args(recipe, workdir, *sets):
    overrides = [arg for s in sets for arg in ("--set", s)]
    return ["train", str(recipe), "--workdir", str(workdir), *overrides]


def run(argv, env, timeout=TIMEOUT):
    """Run to the end; exit code and the output (stdout and stderr together)."""
    done = subprocess.run(
        argv,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout


def launch_run(recipe, workdir, processes=PROCESSES, *sets):
    """The reference: the same training under `jaxdist launch`."""
    argv = [
        *JAXDIST,
        "launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(DEVICES),
        "--",
        *JAXDIST,
        *train_args(recipe, workdir, *sets),
    ]
    code, output = run(argv, clean_env(), timeout=2 * TIMEOUT)
    assert code == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def launched(recipe, tmp_path_factory):
    """The workdir of the recipe trained under `jaxdist launch`."""
    workdir = tmp_path_factory.mktemp("launched") / "run"
    output = launch_run(recipe, workdir)
    assert f"[p0] jaxdist launch: {PROCESSES} processes, coordinator 127.0.0.1:" in output
    return workdir


def lines(output):
    """Output lines; a progress line rewritten in place (\\r) counts once."""
    return [part.strip() for line in output.splitlines() for part in line.split("\r")]


def assert_trains_like(workdir, reference, step=LAST_STEP):
    """The same parameters and optimizer state, bit for bit, and the same losses."""
    got, want = saved_state(workdir, step), saved_state(reference, step)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{name} differs from the `jaxdist launch` run"
    assert train_losses(workdir) == train_losses(reference)


def train_losses(workdir):
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def assert_process_0_speaks(output, source, processes=PROCESSES):
    """One line naming how the peers were found; the summary and results block once."""
    found = [line for line in lines(output) if line.startswith(f"{source}: ")]
    pattern = (
        rf"{source}: {processes} processes, coordinator \S+:\d+; "
        rf"{processes * DEVICES} devices \({DEVICES} per process\)"
    )
    assert len(found) == 1 and re.fullmatch(pattern, found[0]), output[-3000:]
    assert sum(line.startswith("done: step") for line in lines(output)) == 1, output[-3000:]
    assert sum(line.startswith("results in ") for line in lines(output)) == 1, output[-3000:]
    assert sum(line.startswith(f"step {LAST_STEP}/") for line in lines(output)) == 1
    assert "Traceback" not in output
    # The runtime's own lines (gloo's, once per process and communicator) stay off it.
    assert "[Gloo]" not in output, output[-3000:]


def srun(processes=PROCESSES, *options):
    return ["srun", "--ntasks", str(processes), *options, *JAXDIST, "--cpu-devices", str(DEVICES)]


# ------------------------------------------------------------------ the default run


def test_srun_finds_the_processes_from_slurm_and_trains_like_launch(
    slurm, recipe, launched, tmp_path
):
    workdir = tmp_path / "run"
    code, output = run([*srun(), *train_args(recipe, workdir)], clean_env(**slurm))
    assert code == 0, output[-3000:]
    assert_process_0_speaks(output, "SLURM")
    assert_trains_like(workdir, launched)


@pytest.mark.slow  # four processes under mpirun, alone on the machine: about 25 s
def test_mpirun_finds_the_processes_from_open_mpi_and_trains_like_launch(
    mpirun, recipe, launched, tmp_path
):
    workdir = tmp_path / "run"
    argv = [
        *mpirun,
        "-np",
        str(PROCESSES),
        *JAXDIST,
        "--cpu-devices",
        str(DEVICES),
        *train_args(recipe, workdir),
    ]
    code, output = run(argv, clean_env())
    assert code == 0, output[-3000:]
    assert_process_0_speaks(output, "Open MPI")
    assert_trains_like(workdir, launched)


def test_a_mesh_that_does_not_match_the_processes_is_one_line_before_compiling(
    slurm, recipe, tmp_path
):
    """srun starts 2 x 2 devices for a recipe whose mesh has 8: one line, from process 0."""
    workdir = tmp_path / "run"
    code, output = run([*srun(), *train_args(recipe, workdir, "mesh=ring-8")], clean_env(**slurm))
    assert code == 2, output[-3000:]
    said = [line for line in lines(output) if line.startswith("jaxdist")]
    assert said == [
        "jaxdist train: mesh 'ring-8' (8 = 8 devices) does not match this run: 2 processes "
        "with 2 devices each = 4. Start processes x devices = 8 (srun --ntasks, mpirun -np, "
        "jaxdist launch --processes; --cpu-devices on CPU), or give a mesh of 4 devices "
        "(--set mesh=...)"
    ], output[-3000:]
    assert "Traceback" not in output and not re.search(r"^step \d", output, re.M)
    assert not (workdir / "checkpoints").exists()


# ------------------------------------------------------------------ preemption and failures


def job_state(job, slurm):
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job],
        env=clean_env(**slurm),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def wait_for(predicate, timeout, what, alive=lambda: True):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def complete_steps(workdir):
    folder = workdir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    )


@pytest.mark.slow
def test_sbatch_preempted_by_sigterm_is_requeued_and_ends_like_uninterrupted(
    slurm, recipe, launched, tmp_path
):
    """`scancel --signal=TERM` (what a preemption sends): every process saves one step and
    exits 143; the script requeues the job, which resumes and ends like the launch run."""
    workdir, log = tmp_path / "run", tmp_path / "job.out"
    # The script runs `jaxdist`: this Python's, found on PATH.
    env = clean_env(**{**slurm, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{SBIN_PATH}"})
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks",
            str(PROCESSES),
            "--output",
            str(log),
            str(SBATCH_SCRIPT),
            "--cpu-devices",
            str(DEVICES),
            *train_args(recipe, workdir),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: logged_steps(workdir) >= 3, TIMEOUT, "third logged step")
        subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True, timeout=30)
        wait_for(
            lambda: job_state(job, slurm).get("JobState") in ("COMPLETED", "FAILED"),
            2 * TIMEOUT,
            "end of the requeued job",
        )
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    state, output = job_state(job, slurm), log.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1")
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint saved", output)
    assert len(stopped) == PROCESSES and len(set(stopped)) == 1, output[-3000:]
    assert f"requeueing job {job}" in output
    assert f"resumed from step {stopped[0]}" in output
    assert 3 <= int(stopped[0]) < LAST_STEP
    assert "Traceback" not in output
    # Only the trainer's own line says where each process stopped: not orbax's, not XLA's
    # (every process but 0 drops the runtime's warnings).
    assert "Reached preemption sync point" not in output, output[-3000:]
    assert len(re.findall(r"SIGTERM caught", output)) <= 1, output[-3000:]  # process 0's
    assert_trains_like(workdir, launched)


def task_pid(token, rank_variable, rank):
    """The pid of the Python process of ``rank`` among those started with ``token`` (the
    scheduler's own processes have no rank in their environment)."""
    wanted = f"{rank_variable}={rank}\0".encode()
    for pid in sorted(processes_with_env(token)):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            name = Path(f"/proc/{pid}/comm").read_text()
        except OSError:
            continue
        if wanted in environ and name.startswith("python"):
            return pid
    return None


def kill_after_checkpoint(argv, env, workdir, token, rank_variable):
    """Start ``argv``, SIGKILL process 1 once step 4 is saved; (exit code, output, seconds
    from the kill to the end)."""
    proc = subprocess.Popen(
        argv,
        env={**env, "FAULT_TOKEN": token},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(
            lambda: 4 in complete_steps(workdir),
            TIMEOUT,
            "checkpoint of step 4",
            alive=lambda: proc.poll() is None,
        )
        victim = task_pid(token, rank_variable, 1)
        assert victim is not None, "process 1 not found"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        return proc.returncode, output, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_task_killed_under_srun_ends_the_step_and_the_next_run_resumes(
    slurm, recipe, launched, tmp_path
):
    workdir = tmp_path / "run"
    token = f"jaxdist-srun-kill-{os.getpid()}-{time.monotonic_ns()}"
    watchdog_s = 60
    argv = [
        *srun(PROCESSES, "--kill-on-bad-exit=1"),
        *train_args(recipe, workdir, f"watchdog_s={watchdog_s}"),
    ]
    code, output, elapsed = kill_after_checkpoint(
        argv, clean_env(**slurm), workdir, token, "SLURM_PROCID"
    )
    assert code != 0, output[-3000:]
    assert elapsed < watchdog_s, f"the step took {elapsed:.0f} s to end"
    assert processes_with_env(token) == [], "processes survived the step"
    # One line per process, from srun: the killed one and the one srun ended.
    for task in range(PROCESSES):
        assert len(re.findall(rf"^srun: error: \S+: task {task}: ", output, re.M)) == 1, output
    assert "Traceback" not in output
    saved = complete_steps(workdir)
    assert saved and saved[-1] >= 4

    code, output = run(
        [*srun(), *train_args(recipe, workdir, f"watchdog_s={watchdog_s}")], clean_env(**slurm)
    )
    assert code == 0, output[-3000:]
    assert f"resumed from step {saved[-1]}" in output
    assert_trains_like(workdir, launched)


@pytest.mark.slow
def test_a_process_killed_under_mpirun_ends_the_job_in_one_line(mpirun, recipe, launched, tmp_path):
    workdir = tmp_path / "run"
    token = f"jaxdist-mpirun-kill-{os.getpid()}-{time.monotonic_ns()}"
    command = [*JAXDIST, "--cpu-devices", str(DEVICES), *train_args(recipe, workdir)]
    argv = [*mpirun, "-np", str(PROCESSES), *command]
    code, output, elapsed = kill_after_checkpoint(
        argv, clean_env(), workdir, token, "OMPI_COMM_WORLD_RANK"
    )
    assert code != 0, output[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    assert processes_with_env(token) == [], "processes survived the job"
    said = [line for line in lines(output) if "exited on signal 9" in line]
    assert len(said) == 1 and "process rank 1" in said[0], output[-3000:]
    assert "Traceback" not in output, output[-4000:]
    # Nothing half-written is taken for a checkpoint: the rerun resumes from a complete one.
    saved = complete_steps(workdir)
    assert saved and saved[-1] >= 4
    code, output = run([*mpirun, "-np", str(PROCESSES), *command], clean_env())
    assert code == 0, output[-3000:]
    assert f"resumed from step {saved[-1]}" in output
    assert_trains_like(workdir, launched)


# ------------------------------------------------------------------ the recipes, 4 x 2


RECIPES = {
    "mnist_small_batch": ("max_steps=3",),
    "transformer_lm": ("max_steps=3", "data.max_eval_bytes=32768"),
}


@pytest.fixture(scope="module")
def launched_recipes(tmp_path_factory):
    """Each recipe trained under `jaxdist launch` on 4 processes x 2 devices."""
    folder = tmp_path_factory.mktemp("launched_recipes")
    for name, sets in RECIPES.items():
        launch_run(REPO / "recipes" / f"{name}.py", folder / name, 4, *sets)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["srun", "mpirun"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipes_on_4_processes_train_like_launch(
    request, scheduler, name, launched_recipes, tmp_path
):
    if scheduler == "srun":
        env = clean_env(**request.getfixturevalue("slurm"))
        argv = srun(4)
    else:
        env = clean_env()
        argv = [
            *request.getfixturevalue("mpirun"),
            "-np",
            "4",
            *JAXDIST,
            "--cpu-devices",
            str(DEVICES),
        ]
    workdir = tmp_path / name
    code, output = run(
        [*argv, *train_args(REPO / "recipes" / f"{name}.py", workdir, *RECIPES[name])],
        env,
        timeout=2 * TIMEOUT,
    )
    assert code == 0, output[-3000:]
    source = "SLURM" if scheduler == "srun" else "Open MPI"
    assert re.search(rf"^{source}: 4 processes, coordinator \S+; 8 devices", output, re.M)
    assert_trains_like(workdir, launched_recipes / name, step=3)
