"""Compiles for GPU hosts without a GPU, in a process of its own that has the GPU compiler on
its path (``tools/install-gpu-compiler``), and prints what tests/test_gpu_plan.py checks, as
one JSON object on the last line of stdout."""

import contextlib
import io
import json

import numpy as np
from jax.sharding import Mesh

from jaxdist.aot.topology import parse_topology
from jaxdist.cli import main
from tests.test_aot import OWN_TASK, compile_step


def schedule_facts(report) -> dict:
    grads = report.schedule.gradient_collectives
    return {
        "gradient_collectives": len(grads),
        "asynchronous": sum(c.asynchronous for c in grads),
        "overlapped_backward_fraction": report.schedule.overlapped_backward_fraction,
        "flops": report.flops,
        "memory_total": report.memory.total,
    }


def run() -> dict:
    mesh = Mesh(np.asarray(parse_topology("h100:2x4").devices()).reshape(2, 4), ("y", "x"))
    torus = compile_step(mesh, allreduce="torus2d", data_axes=("y", "x"), bucket_bytes=1 << 19)
    line = Mesh(np.asarray(parse_topology("h100:1x4").devices()), ("data",))
    native = compile_step(line, allreduce="native", bucket_bytes=1 << 19)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            [
                "plan",
                OWN_TASK,
                "--topology",
                "h100:2x4",
                "--efficiency",
                "0.3",
                "--set",
                "mesh=hierarchical-2x4",
                "--json",
            ]
        )
    return {
        "torus2d_h100_2x4": schedule_facts(torus),
        "native_h100_1x4": schedule_facts(native),
        "plan_exit_code": code,
        "plan": json.loads(printed.getvalue()) if code == 0 else printed.getvalue(),
    }


if __name__ == "__main__":
    print(json.dumps(run()))
