"""Real multi-process JAX runs through ``jaxdist launch``: collectives, meshes, the benchmark.

Each launch runs several checks, because every process pays for importing JAX and compiling:
one launch per layout (2 processes x 2 devices, 4 x 1) and one of the benchmark. The workers
are ``tests/multiprocess_worker.py``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxdist.comm.collectives import ALGORITHMS, SHARDED_ALGORITHMS
from jaxdist.data.fake import write_image_folder
from tests._procs import JAXDIST, REPO, WORKER, clean_env

pytestmark = pytest.mark.multiprocess


def run_launch(
    processes: int,
    devices: int,
    *command: str,
    timeout: int = 150,
    env: dict[str, str] | None = None,
) -> str:
    argv = [
        *JAXDIST,
        "launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(devices),
        "--timeout",
        str(timeout - 10),
        "--",
        *command,
    ]
    proc = subprocess.run(
        argv,
        env=clean_env(**(env or {})),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"expected exit 0 from {' '.join(argv)}, found {proc.returncode}:\n{output}"
    )
    return output


def assert_all_algorithms(output: str, processes: int, layout: str) -> None:
    for p in range(processes):
        for algorithm in ALGORITHMS:
            line = f"[p{p}] CHECK allreduce {algorithm} {layout} OK"
            assert line in output, f"expected {line!r} in the output, not found:\n{output}"
        for algorithm in (a for a in SHARDED_ALGORITHMS if a != "torus3d"):
            line = f"[p{p}] CHECK halves {algorithm} {layout} OK"
            assert line in output, f"expected {line!r} in the output, not found:\n{output}"
        line = f"[p{p}] CHECK native reduce-scatter over gloo is an all-reduce {layout} OK"
        assert line in output, f"expected {line!r} in the output, not found:\n{output}"
        # ring and torus2d exchange only on a 2-device axis ("2x2"; not "4x1"); the
        # bidirectional ring's steps go in pieces on every layout (all have 4 devices).
        has_pair_axis = "2" in layout.split("x")
        pieced = ("halving_doubling", "bidirectional_ring")
        if has_pair_axis:
            pieced += ("ring", "torus2d")
        for algorithm in pieced:
            line = f"[p{p}] CHECK pieces {algorithm} {layout} OK"
            assert line in output, f"expected {line!r} in the output, not found:\n{output}"


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """One launch of 2 processes x 2 devices for every check on that layout: its output, and
    the folder where its train cases left their final states."""
    folder = tmp_path_factory.mktemp("two_by_two")
    images = write_image_folder(
        folder / "images",
        num_classes=DALI_SAMPLES,
        train_per_class=1,
        val_per_class=1,
        size_range=(24, 48),
    )
    env = {"JAXDIST_TEST_OUT_DIR": str(folder), "JAXDIST_TEST_DALI_ROOT": str(images)}
    output = run_launch(2, 2, sys.executable, WORKER, "mesh", "allreduce", "train", "dali", env=env)
    return output, folder


DALI_SAMPLES = 24  # one image per class: a label names its sample


def test_dali_loader_on_two_processes_sees_every_sample_once_and_resumes(two_by_two):
    """Each process's share, as the grain loader cuts it, resumed exactly (checked in the
    workers); together the two processes see every sample of the epoch exactly once."""
    output, folder = two_by_two
    for p in range(2):
        assert f"[p{p}] CHECK dali OK batches=3 resumed=2" in output, output
    labels = np.concatenate([np.load(folder / f"dali-p{p}.npz")["labels"] for p in range(2)])
    assert sorted(labels.tolist()) == list(range(DALI_SAMPLES)), (
        f"expected each of {DALI_SAMPLES} samples once in the epoch, found {sorted(labels)}"
    )


def test_two_processes_two_devices_all_algorithms_and_host_rows(two_by_two):
    output, _ = two_by_two
    assert "[p0] process 0 of 2: 2 local / 4 devices (jaxdist-env)" in output, output
    assert "[p1] process 1 of 2: 2 local / 4 devices (jaxdist-env)" in output, output
    for p in range(2):
        assert f"[p{p}] CHECK mesh OK rows=[[0, 0], [1, 1]]" in output, output
    # `mesh show`-style grid: host 0's devices on the first row, host 1's on the second.
    grid = [line for line in output.splitlines() if line.startswith("[p0]     host=")]
    assert len(grid) == 2 and all(
        f"[{h}]" in row and f"[{1 - h}]" not in row for h, row in enumerate(grid)
    ), f"rows by host: {grid}"
    assert_all_algorithms(output, 2, "2x2")


@pytest.mark.slow  # the 2 x 2 launch checks every algorithm across processes in the default run
def test_four_processes_one_device_all_algorithms():
    output = run_launch(4, 1, sys.executable, WORKER, "allreduce")
    assert_all_algorithms(output, 4, "4x1")
    assert_all_algorithms(output, 4, "2x2")  # 2x2 grid whose inner axis crosses processes


def test_bench_allreduce_runs_unchanged_and_only_process_0_prints_the_table():
    output = run_launch(
        2,
        2,
        *JAXDIST,
        "bench",
        "allreduce",
        "--mesh",
        "ring-4",
        "--sizes",
        "16K,64K",
        "--algorithms",
        "ring,native",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--quiet",
    )
    table = [line for line in output.splitlines() if "busbw" in line]
    assert table and all(line.startswith("[p0]") for line in table), (
        f"expected the table header from process 0 only, found {table}:\n{output}"
    )
    for algorithm in ("ring", "native"):
        assert any(
            line.startswith("[p0]") and f" {algorithm} " in line for line in output.splitlines()
        ), f"no {algorithm} row:\n{output}"


def test_train_step_on_two_processes_matches_one_process(two_by_two):
    """2 processes x 2 devices, each feeding the rows of the replicas it holds (its half of
    the global batch; all of it where a tensor axis spans both), end with the same
    parameters and BatchNorm statistics as one process of 4 devices fed the whole batch."""
    from tests.multiprocess_worker import TRAIN_CASES, train_case

    output, folder = two_by_two
    for name in TRAIN_CASES:
        # One process with the same global batch and mesh shape: the first 4 of this test
        # process's 8 devices, running exactly the workers' code.
        expected, expected_loss = train_case(name, 4)
        for p in range(2):
            assert f"[p{p}] CHECK train {name} OK" in output, output
            saved = np.load(folder / f"train-{name}-p{p}.npz")
            assert sorted(k for k in saved.files if k != "loss") == sorted(expected), (
                f"{name}: expected leaves {sorted(expected)}, process {p} saved {saved.files}"
            )
            for key, value in expected.items():
                np.testing.assert_allclose(
                    saved[key],
                    value,
                    rtol=0,
                    atol=2e-6,
                    err_msg=f"{name}: {key} on process {p} of 2 vs one process",
                )
            np.testing.assert_allclose(
                saved["loss"], expected_loss, rtol=0, atol=2e-6, err_msg=f"{name}: last loss"
            )


LM_SETTINGS = {
    "max_steps": "4",
    "log_every_steps": "2",
    "eval_every_epochs": "0",
    "batch_size": "16",
    "model.num_layers": "1",
    "model.d_model": "64",
    "model.tie_embeddings": "True",
    "data.seq_len": "32",
    "data.max_train_bytes": "100000",
    "data.max_eval_bytes": "20000",
}


def test_a_tensor_axis_across_two_processes_trains_as_one_process(tmp_path):
    """`jaxdist train` of the language model on 2 processes x 2 devices with the tensor axis
    across the processes (its tied vocabulary split, the collective matmul): both processes
    read the same rows of every batch, and the run logs the losses and held-out bits per
    byte of one process training the same batches data-parallel on 4 devices."""
    import json

    from jaxdist.run.config import load_recipe
    from jaxdist.run.trainer import Trainer
    from jaxdist.tasks.language_model import LanguageModel
    from tests._procs import JAXDIST

    sets = {
        **LM_SETTINGS,
        "mesh": "tensor=2,data=2",
        "logical_axis_rules": "vocab=tensor",
        "tensor_schedule": "collective_matmul",
    }
    workdir = tmp_path / "across"
    recipe = str(REPO / "recipes" / "transformer_lm.py")
    overrides = [arg for name, value in sets.items() for arg in ("--set", f"{name}={value}")]
    run_launch(2, 2, *JAXDIST, "train", recipe, "--workdir", str(workdir), *overrides)
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]

    config = load_recipe(recipe)
    for name, value in LM_SETTINGS.items():
        section, _, field = name.rpartition(".")
        target = config[section] if section else config
        target[field] = (
            value == "True" if isinstance(target[field], bool) else type(target[field])(value)
        )
    config.mesh = "data=4"
    one = tmp_path / "one"
    Trainer(config, one, task=LanguageModel).run()
    expected = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in logged] == [r["kind"] for r in expected] == ["train"] * 2 + ["eval"]
    for got, want in zip(logged, expected, strict=True):
        key = "loss" if got["kind"] == "train" else "bits_per_byte"
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{got}")
