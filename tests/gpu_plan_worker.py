"""Compiles for GPU hosts without a GPU, in a process of its own that has the GPU compiler on
its path (``tools/install-gpu-compiler``), and prints what tests/test_gpu_plan.py checks, as
one JSON object on the last line of stdout."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.aot.schedule import read_schedule
from jaxdist.aot.topology import parse_topology
from jaxdist.cli import main
from jaxdist.comm.collective_matmul import gathered_product, summed_product
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


def collective_matmul_windows() -> dict:
    """The collective matmul's products in the GPU compiler's order, over 8 H100s: of each
    form's permutes, how many run with a product inside their start..done window."""
    mesh = Mesh(np.asarray(parse_topology("h100:1x8").devices()), ("tensor",))
    rows, inner, out = 1024, 8 * 512, 8 * 256
    forms = {
        "summed": (
            lambda x, w: summed_product(x, w, "tensor", "collective_matmul"),
            P(None, "tensor"),
            P("tensor"),
        ),
        "gathered": (
            lambda x, w: gathered_product(x, w, "tensor", "collective_matmul")[0],
            P("tensor"),
            P(None, "tensor"),
        ),
    }
    facts = {}
    for name, (body, row_spec, weight_spec) in forms.items():
        step = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(row_spec, weight_spec), out_specs=P(), check_vma=False
            )
        )
        x = jax.ShapeDtypeStruct(
            (rows, inner), jnp.bfloat16, sharding=NamedSharding(mesh, row_spec)
        )
        w = jax.ShapeDtypeStruct(
            (inner, out), jnp.bfloat16, sharding=NamedSharding(mesh, weight_spec)
        )
        schedule = read_schedule(step.lower(x, w).compile().as_text(), num_devices=8)
        permutes = [c for c in schedule.collectives if c.kind == "collective-permute"]
        facts[name] = {
            "permutes": len(permutes),
            "with_a_product": sum(c.compute_between > 0 for c in permutes),
        }
    return facts


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
        "collective_matmul_h100_1x8": collective_matmul_windows(),
        "plan_exit_code": code,
        "plan": json.loads(printed.getvalue()) if code == 0 else printed.getvalue(),
    }


if __name__ == "__main__":
    print(json.dumps(run()))
