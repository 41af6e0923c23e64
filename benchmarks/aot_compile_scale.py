"""Compile time and memory of one train step as the TPU slice grows, for each allreduce.

    python benchmarks/aot_compile_scale.py [--topologies v5e:2x2,v5e:16x16,v5p:8x8x16,...]
        [--algorithms native,ring,torus2d] [--unroll-limits 16,100000]

Each configuration compiles in a process of its own (the TPU compiler, no TPU), so its peak
resident memory is its own. The step is an MLP of eight 2048-wide layers (33.6M parameters)
on 64 examples per chip, gradients in 16 MiB buckets: the model's compute per chip is the
same on every slice, so what changes with the slice is the communication the program holds.
The table says, per slice and schedule: seconds to lower and compile, peak memory of the
compiling process, the gradient collectives (how many instructions, how many inside a loop)
and the share of backward matrix products that run while gradients are in flight.
``benchmarks/results/aot_compile_scale.json`` keeps the rows; a run replaces the rows of the
configurations it compiles and keeps the rest.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "aot_compile_scale.json"
DEFAULT_TOPOLOGIES = "v5e:2x2,v5e:4x4,v5e:16x16,v5p:8x8x16,v5p:16x16x16"


def compile_one(topology_name: str, algorithm: str, unroll_limit: int) -> dict:
    """Compile the MLP step on ``topology_name`` and report (in this process)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    jax.config.update("jax_platforms", "cpu")
    from jaxdist import meshes
    from jaxdist.aot.compile import compile_train_step
    from jaxdist.aot.topology import parse_topology
    from jaxdist.training.step_options import Communication
    from jaxdist.training.train_step import TrainStep

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(8):
                x = nn.relu(nn.Dense(2048)(x))
            return nn.Dense(10)(x)

    model = MLP()

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    topology = parse_topology(topology_name)
    started = time.perf_counter()
    devices = topology.devices()
    describe_seconds = time.perf_counter() - started
    chips = topology.num_chips
    if algorithm in ("torus2d", "hierarchical"):
        inner = topology.shape[0]
        spec = meshes.MeshSpec("scale", "torus2d", (("y", chips // inner), ("x", inner)))
    else:
        spec = meshes.MeshSpec("scale", "ring", (("data", chips),))
    mesh = meshes.build(spec, devices)
    step = TrainStep(
        loss_fn,
        optax.sgd(0.1, 0.9),
        mesh,
        communication=Communication(algorithm, options={"unroll_limit": unroll_limit}),
    )
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2048)))["params"])
    batch = {"x": ((64 * chips, 2048), jnp.bfloat16), "y": ((64 * chips,), jnp.int32)}
    started = time.perf_counter()
    report = compile_train_step(step, params, {}, batch)
    total_seconds = time.perf_counter() - started
    grads = report.schedule.gradient_collectives
    return {
        "topology": topology_name,
        "chips": chips,
        "algorithm": algorithm,
        "unroll_limit": unroll_limit,
        "describe_seconds": describe_seconds,
        "lower_and_compile_seconds": total_seconds,
        "compile_seconds": report.compile_seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gradient_collective_instructions": len(grads),
        "gradient_collectives_in_loops": sum(c.in_loop for c in grads),
        "gradient_collectives_per_step": sum(c.turns for c in grads),
        "overlapped_backward_fraction": report.schedule.overlapped_backward_fraction,
        "temp_mib": report.memory.temp / 2**20,
    }


def _key(row: dict) -> tuple[str, str, int]:
    return row["topology"], row["algorithm"], int(row["unroll_limit"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default=DEFAULT_TOPOLOGIES)
    parser.add_argument("--algorithms", default="native,ring,torus2d")
    parser.add_argument("--unroll-limits", default="16,100000")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per compile")
    parser.add_argument(
        "--one", nargs=3, metavar=("TOPOLOGY", "ALGORITHM", "UNROLL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(compile_one(args.one[0], args.one[1], int(args.one[2]))))
        return 0
    rows = []
    print(
        "| slice | chips | allreduce | unroll limit | compile (s) | peak memory (MiB) "
        "| gradient collectives (in loops) | backward overlapped |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for topology in args.topologies.split(","):
        for algorithm in args.algorithms.split(","):
            limits = args.unroll_limits.split(",") if algorithm != "native" else ["0"]
            for limit in limits:
                try:
                    done = subprocess.run(
                        [sys.executable, __file__, "--one", topology, algorithm, limit],
                        capture_output=True,
                        text=True,
                        check=False,
                        timeout=args.timeout,
                    )
                except subprocess.TimeoutExpired:
                    rows.append(
                        {
                            "topology": topology,
                            "algorithm": algorithm,
                            "unroll_limit": int(limit),
                            "timed_out": args.timeout,
                        }
                    )
                    print(
                        f"| {topology} | | {algorithm} | {limit} | over {args.timeout:.0f} | | | |",
                        flush=True,
                    )
                    continue
                if done.returncode:
                    print(f"{topology} {algorithm} {limit}: failed: {done.stderr[-2000:]}")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"| {topology} | {row['chips']} | {algorithm} | "
                    f"{'-' if algorithm == 'native' else limit} "
                    f"| {row['lower_and_compile_seconds']:.1f} | {row['peak_rss_mib']:,.0f} "
                    f"| {row['gradient_collective_instructions']} "
                    f"({row['gradient_collectives_in_loops']}) "
                    f"| {row['overlapped_backward_fraction']:.0%} |",
                    flush=True,
                )
    # Configurations compiled here replace their earlier rows; the others' rows stay.
    merged = {_key(r): r for r in json.loads(RESULTS.read_text())} if RESULTS.exists() else {}
    merged.update({_key(r): r for r in rows})
    RESULTS.write_text(json.dumps(list(merged.values()), indent=2) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
