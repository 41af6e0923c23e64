"""The README's commands, run in order exactly as written: the main job after its set-up, then
every command of the tour (``jaxdist`` found on PATH as the set-up's activated environment
puts it there). Slow: the main job alone trains for about two minutes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests._procs import REPO, clean_env
from tests.test_cluster import _PROBLEM as NAMESPACE_PROBLEM

README = (REPO / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def readme_commands() -> list[str]:
    """The main job (the first set-up command's last part), then the tour's commands, with
    continuation lines joined and comments dropped."""
    setup, _tests, tour = _bash_blocks()[:3]
    main_job = setup.strip().split(" && ")[-1]
    joined = tour.replace("\\\n", " ")
    tour_commands = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [main_job, *(c for c in tour_commands if c)]


def test_the_readme_has_the_commands_this_test_runs():
    commands = readme_commands()
    assert commands[0].startswith("jaxdist --cpu-devices 2 train recipes/mnist_large_batch_ramp")
    assert commands[1] == 'pip install -e ".[plot,tpu]"'  # what the tour uses, installed first
    assert all(c.startswith("jaxdist ") for c in commands[2:]), commands
    assert commands[-1] == "jaxdist plot runs/mnist_large_batch_ramp"


@pytest.mark.slow
def test_readme_commands_run_in_order_as_written(tmp_path):
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the tour's own-task recipe
    env = clean_env()
    # What `. .venv/bin/activate` does for the commands: the environment's bin first on PATH.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    for command in readme_commands():
        if command.startswith("jaxdist cluster") and NAMESPACE_PROBLEM is not None:
            continue  # needs root and network namespaces; tests/test_cluster.py covers it
        # The install line runs where the README's set-up ran it: in the clone.
        where = REPO if command.startswith("pip ") else tmp_path
        proc = subprocess.run(
            shlex.split(command),
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, (
            f"README command failed ({proc.returncode}): {command}\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    assert (tmp_path / "busbw.png").exists()
    assert (tmp_path / "runs" / "mnist_large_batch_ramp" / "metrics.jsonl").exists()
