"""Peak memory per device of a pipeline step as the micro-batch count grows: GPipe against 1F1B,
1F1B against PipeDream's weight stashing and 2BW's two versions, and each stage's state
replicated over data-parallel replicas against split over them (FSDP inside the stages).

    python benchmarks/pipeline_memory.py [--stages 4] [--microbatches 1,2,4,8,16,32]
        [--topology cpu|v5e:2x2|...] [--plot docs/pipeline_memory.png]
        [--schedules gpipe,1f1b | 1f1b,pipedream,pipedream_2bw]
        [--replicas 4 --sharding replicated,fsdp]

The model is an MLP of eight 1024-wide layers cut into ``--stages`` equal stages; each
micro-batch holds 1,024 examples, so the global batch grows with M while each op's work stays
the same. ``--replicas`` adds data-parallel replicas of the pipeline (each with its own
micro-batches; gradients averaged by the ring), and ``--sharding`` lists how each stage's state
is kept over them. Every configuration is compiled (not run) and XLA's own figures are read from
``compiled.memory_analysis()``: arguments (the stage's parameters, optimizer state and the
batch), temporaries (the activation and gradient stashes, the recomputed forward, the
messages) and their sum. ``--topology cpu`` compiles for forced CPU devices; a TPU slice name
compiles for compile-only TPU devices (:mod:`jaxdist.aot`). Rows go to
``benchmarks/results/pipeline_memory_<topology>.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
WIDTH, LAYERS, MICRO_BATCH = 1024, 8, 1024


def devices_for(topology: str, count: int):
    if topology == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        return jax.devices()[:count]
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jaxdist.aot.topology import parse_topology

    return parse_topology(topology).devices()[:count]


def model_stages(model: str, stages: int, micro_batch: int):
    """(stage modules, example input, loss_fn, batch shapes for M micro-batches)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist.pipeline import stages as pipeline_stages

    if model == "resnet152":
        from jaxdist.models.resnet import resnet152

        network = resnet152(dtype=jnp.bfloat16)
        bounds = [round(i * network.num_layers / stages) for i in range(stages)]
        modules = pipeline_stages.split_module(network, boundaries=bounds)
        example = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)

        def loss_fn(logits, micro_batch):
            labels = micro_batch["y"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

        def batch(M):
            n = M * micro_batch
            return {"x": ((n, 224, 224, 3), jnp.float32), "y": ((n,), jnp.int32)}

        return modules, example, loss_fn, batch

    class Dense(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x, *, train):
            return nn.relu(nn.Dense(self.features)(x))

    layers = [Dense(WIDTH) for _ in range(LAYERS)]
    modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=stages)]

    def loss_fn(outputs, micro_batch):
        return jnp.mean((outputs - micro_batch["y"]) ** 2), {}

    def batch(M):
        shape = (M * micro_batch, WIDTH)
        return {"x": (shape, jnp.float32), "y": (shape, jnp.float32)}

    return modules, jax.ShapeDtypeStruct((1, WIDTH), jnp.float32), loss_fn, batch


def measure(
    topology: str,
    stages: int,
    schedules: list[str],
    micro_batches: list[int],
    model: str = "mlp",
    micro_batch: int = MICRO_BATCH,
    replicas: int = 1,
    shardings: tuple[str, ...] = ("replicated",),
) -> list:
    devices = devices_for(topology, stages * replicas)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxdist import meshes
    from jaxdist.pipeline import stages as pipeline_stages
    from jaxdist.pipeline.step import PipelineStep
    from jaxdist.training.step_options import Communication, StateSharding

    modules, example, loss_fn, batch_shapes = model_stages(model, stages, micro_batch)
    params, model_state = jax.eval_shape(
        lambda x: pipeline_stages.init_flax_stages(modules, jax.random.key(0), x),
        jnp.zeros(example.shape, example.dtype),
    )
    if replicas > 1:
        mesh = meshes.pipeline(replicas, stages, devices)
    else:
        mesh = Mesh(np.array(devices), ("stage",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = []
    for schedule, sharding in ((s, h) for h in shardings for s in schedules):
        for M in micro_batches:
            step = PipelineStep(
                pipeline_stages.flax_stages(modules),
                loss_fn,
                optax.sgd(0.1, 0.9) if model == "resnet152" else optax.adam(1e-3),
                mesh,
                microbatches=M,
                schedule=schedule,
                inputs=lambda b: b["x"],
                communication=Communication("ring" if replicas > 1 else "native"),
                sharding=StateSharding(sharding),
            )
            state = step.abstract_init(params, model_state)
            split = NamedSharding(mesh, PartitionSpec(step.data_axes or None))
            batch = {
                name: jax.ShapeDtypeStruct((shape[0] * replicas, *shape[1:]), dtype, sharding=split)
                for name, (shape, dtype) in batch_shapes(M).items()
            }
            rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
            memory = step.lower(state, batch, rng).compile().memory_analysis()
            row = {
                "topology": topology,
                "model": model,
                "micro_batch": micro_batch,
                "stages": stages,
                "replicas": replicas,
                "sharding": sharding,
                "schedule": schedule,
                "microbatches": M,
                "stash_slots": step.program.input_slots,
                # Parameter copies a device holds: the newest, plus PipeDream's stashed versions
                # or 2BW's older one.
                "weight_versions": 1
                + (
                    step.program.weight_slots
                    if schedule == "pipedream"
                    else schedule == "pipedream_2bw"
                ),
                "bubble": step.program.schedule.bubble_fraction,
                "argument_mib": memory.argument_size_in_bytes / 2**20,
                "temp_mib": memory.temp_size_in_bytes / 2**20,
                "peak_mib": (
                    memory.argument_size_in_bytes
                    + memory.temp_size_in_bytes
                    + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes
                )
                / 2**20,
            }
            rows.append(row)
            print(
                f"| {schedule} | {sharding} | {M} | {row['stash_slots']} | {row['weight_versions']} | "
                f"{row['bubble']:.3f} | "
                f"{row['argument_mib']:.1f} | {row['temp_mib']:.1f} | {row['peak_mib']:.1f} |",
                flush=True,
            )
    return rows


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == schedule]
        ax.plot(
            [r["microbatches"] for r in mine], [r["temp_mib"] for r in mine], "o-", label=schedule
        )
    first = rows[0]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (M)")
    ax.set_ylabel("temporary memory per device (MiB)")
    ax.set_title(
        f"{first['model']}, {first['stages']} stages, {first['micro_batch']} examples "
        f"per micro-batch ({first['topology']})"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="1,2,4,8,16,32")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--topology", default="cpu")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="data-parallel replicas of the pipeline (devices: stages x replicas)",
    )
    parser.add_argument(
        "--sharding",
        default="replicated",
        help="how each stage's state is kept over the replicas: replicated, fsdp "
        "or both, comma-separated",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=("mlp", "resnet152"),
        help="mlp (eight 1024-wide layers) or resnet152 (224x224, bf16)",
    )
    parser.add_argument(
        "--micro-batch", type=int, default=MICRO_BATCH, help="examples per micro-batch"
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the chart here")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="rows to this file (default benchmarks/results/pipeline_memory_<topology>.json)",
    )
    args = parser.parse_args(argv)
    print(
        "| schedule | sharding | M | stash slots | weight versions | bubble | arguments (MiB) | "
        "temporaries (MiB) | peak (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = measure(
        args.topology,
        args.stages,
        args.schedules.split(","),
        [int(m) for m in args.microbatches.split(",")],
        args.model,
        args.micro_batch,
        args.replicas,
        tuple(args.sharding.split(",")),
    )
    name = f"{args.topology.replace(':', '_')}" + ("" if args.model == "mlp" else f"_{args.model}")
    name += "" if args.replicas == 1 else f"_replicas{args.replicas}"
    out = args.json or RESULTS / f"pipeline_memory_{name}.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"rows in {out}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"chart in {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
