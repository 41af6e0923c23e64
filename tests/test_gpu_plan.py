"""Steps and plans compiled for GPU hosts without a GPU, by JAX's CUDA plugin. The plugin lives
in a folder of its own (``tools/install-gpu-compiler``, which the README's test command runs),
loaded only by the one process these tests start: beside JAX it would be loaded by every
process the other tests start, each printing that it found no CUDA driver."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdist.aot.topology import cuda_plugin_available
from tests._procs import clean_env

REPO = Path(__file__).resolve().parents[1]
# Where tools/install-gpu-compiler puts the plugin; JAXDIST_GPU_COMPILER names another folder.
GPU_COMPILER = Path(os.environ.get("JAXDIST_GPU_COMPILER", REPO / ".venv" / "gpu-compiler"))


def _compiler_path() -> str | None:
    """The folder to put on the worker's path ("" where the plugin is installed beside JAX),
    or None where the GPU compiler is not installed."""
    if any(GPU_COMPILER.glob("jax_plugins/xla_cuda1*")):
        return str(GPU_COMPILER)
    return "" if cuda_plugin_available() else None


@pytest.fixture(scope="module")
def compiled():
    """One process compiles every GPU case of this file (the plugin loads once)."""
    folder = _compiler_path()
    if folder is None:
        pytest.skip(
            f"the GPU compiler is not installed: run tools/install-gpu-compiler (into "
            f"{GPU_COMPILER}), or pip install -e '.[gpu-plan]'"
        )
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, str(REPO)) if p)
    env["JAX_PLATFORMS"] = "cpu"  # the GPU compiler runs where JAX itself runs on the CPU
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_plan_worker"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_step_compiles_for_gpu_hosts_without_a_gpu(compiled):
    several = compiled["torus2d_h100_2x4"]
    assert several["gradient_collectives"] > 0
    assert several["asynchronous"] == several["gradient_collectives"]
    assert several["overlapped_backward_fraction"] > 0
    # The GPU compiler counts no FLOPs without a GPU: the step's count is its optimized
    # program's matrix products, exactly the forward and backward products (for weights
    # and, but the first layer, inputs; 8 examples per GPU).
    macs = [256 * 512, 512 * 384, 384 * 512, 512 * 256, 256 * 10]
    assert several["flops"] == 2 * 8 * (3 * sum(macs) - macs[0])
    assert several["memory_total"] > 0


def test_native_buckets_stay_apart_on_gpu_hosts(compiled):
    native = compiled["native_h100_1x4"]
    assert native["gradient_collectives"] > 2 and native["overlapped_backward_fraction"] > 0


def test_plan_command_for_gpu_hosts(compiled):
    assert compiled["plan_exit_code"] == 0, compiled["plan"]
    plan = compiled["plan"]
    assert plan["chips"] == 8 and plan["chip"] == "NVIDIA H100 SXM5"
    assert plan["stages"][0]["fits"] is True
    # The recipe's MLP (1 -> 64 -> 1) leaves the GPU compiler no matrix product (each becomes a
    # broadcast or a reduction): its products are counted as traced, 8 examples per GPU, the
    # forward's two and backward's three (no input gradient for the first layer).
    assert plan["stages"][0]["flops_per_chip"] == 2 * 8 * 64 * 5


def test_each_collective_matmul_permute_on_gpu_has_a_product_beside_it(compiled):
    """Over 8 H100s: each of the reduce-scatter's 2 x 7 permutes runs beside a product, and
    each of the gathered product's. The GPU compiler merges products that share a weight,
    which left every permute of both forms without one before each product waited for the
    one before it."""
    windows = compiled["collective_matmul_h100_1x8"]
    assert windows["summed"]["permutes"] == 2 * 2 * 7  # reduce-scatter, then all-gather
    assert windows["summed"]["with_a_product"] >= 2 * 7
    assert windows["gathered"]["with_a_product"] == windows["gathered"]["permutes"] == 2 * 7
