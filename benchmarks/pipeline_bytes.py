"""Bytes each device sends per step: a pipeline against data parallelism on the same devices.

    python benchmarks/pipeline_bytes.py [--mesh pipeline-2x4] [--microbatches 8]
        [--micro-batch 32] [--link 50us:1Gbit] [--schedules gpipe,1f1b,interleaved]

PipeDream's argument: data parallelism sends every parameter's gradient each step, a pipeline
sends activations between neighbouring stages plus each stage's gradients among its replicas.
For a model of large dense layers (a 25088-wide input, as VGG-16's classifier sees, then
seven 4096-wide layers and a 1000-way output; the interleaved schedule runs the same eight
layers as 2 chunks per device) the first is far larger. Stage gradients are padded to the
largest stage's size, so the figure is that of the devices holding the largest stage. The step is traced (not
run) on forced CPU devices, and the bytes come from the program itself: the activation
messages its schedule sends (:attr:`jaxdist.pipeline.program.Program.messages_per_step`,
each the largest boundary's size) and its stage gradients, allreduced by a ring over the data
axes. The cost model prices both on ``--link``. ``benchmarks/results/pipeline_bytes.json``
keeps the rows (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "pipeline_bytes.json"
WIDTHS = (4096,) * 7 + (1000,)
INPUT = 25088


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="pipeline-2x4")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32, help="examples per micro-batch")
    parser.add_argument("--link", default="50us:1Gbit", help="LATENCY:BANDWIDTH of every link")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"rows to this file ({RESULTS})")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist import meshes
    from jaxdist.comm import cost_model
    from jaxdist.pipeline import stages as pipeline_stages
    from jaxdist.pipeline.step import PipelineStep

    class Dense(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x, *, train):
            return nn.relu(nn.Dense(self.features)(x))

    mesh = meshes.build(args.mesh)
    S = mesh.shape["stage"]
    replicas = mesh.size // S
    link = cost_model.parse_link(args.link)
    M, b = args.microbatches, args.micro_batch

    def ring_bytes(nbytes: float, n: int) -> float:
        return 2 * (n - 1) / n * nbytes if n > 1 else 0.0

    def ring_seconds(nbytes: float, n: int) -> float:
        return cost_model.predict("ring", nbytes, (n,), link) if n > 1 else 0.0

    rows = []
    print(
        f"# {args.mesh}: {replicas} replica(s) x {S} stages; {M} micro-batches of {b} per "
        f"replica; links {args.link}"
    )
    print("| training | messages/step | bytes sent per device per step | predicted seconds |")
    print("|---|---|---|---|")
    for schedule in args.schedules.split(","):
        chunks = 2 if schedule == "interleaved" else 1
        layers = [Dense(w) for w in WIDTHS]
        modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=S * chunks)]
        params, x = [], jax.ShapeDtypeStruct((1, INPUT), jnp.float32)
        for module in modules:
            variables = jax.eval_shape(
                lambda x, m=module: m.init(jax.random.key(0), x, train=False), x
            )
            params.append(variables["params"])
            x = jax.eval_shape(lambda v, x, m=module: m.apply(v, x, train=False), variables, x)
        step = PipelineStep(
            pipeline_stages.flax_stages(modules),
            lambda y, mb: (jnp.mean((y - mb["y"]) ** 2), {}),
            optax.sgd(0.1),
            mesh,
            microbatches=M,
            schedule=schedule,
            chunks=chunks,
            inputs=lambda batch: batch["x"],
        )
        state = step.abstract_init(params)
        batch_sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(step.data_axes)
        )
        batch = {
            "x": jax.ShapeDtypeStruct(
                (replicas * M * b, INPUT), jnp.float32, sharding=batch_sharding
            ),
            "y": jax.ShapeDtypeStruct(
                (replicas * M * b, WIDTHS[-1]), jnp.float32, sharding=batch_sharding
            ),
        }
        rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        step.lower(state, batch, rng)  # traces the step: the activation layout is known after
        sent_by = step.bytes_per_step()
        messages, message = sent_by["messages"], sent_by["message_bytes"]
        gradient = sent_by["gradient_bytes"]
        sent = messages * message + ring_bytes(gradient, replicas)
        seconds = messages * (link.alpha + message * link.beta) + ring_seconds(gradient, replicas)
        rows.append(
            {
                "training": f"pipeline {schedule}",
                "messages": messages,
                "message_bytes": message,
                "stage_gradient_bytes": gradient,
                "bytes_sent": sent,
                "predicted_seconds": seconds,
            }
        )
        model_bytes = sum(4 * x.size for p in params for x in jax.tree.leaves(p))
        print(
            f"| pipeline {schedule} | {messages} of {message / 2**20:.2f} MiB + ring of "
            f"{gradient / 2**20:.0f} MiB over {replicas} | {sent / 2**20:.0f} MiB | "
            f"{seconds:.2f} |"
        )
    data_parallel = ring_bytes(model_bytes, mesh.size)
    seconds = ring_seconds(model_bytes, mesh.size)
    rows.append(
        {
            "training": "data parallel",
            "model_bytes": model_bytes,
            "bytes_sent": data_parallel,
            "predicted_seconds": seconds,
        }
    )
    print(
        f"| data parallel, ring over {mesh.size} | {2 * (mesh.size - 1)} | "
        f"{data_parallel / 2**20:.0f} MiB | {seconds:.2f} |"
    )
    args.json.write_text(
        json.dumps(
            {
                "mesh": args.mesh,
                "link": args.link,
                "microbatches": M,
                "micro_batch": b,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
