"""Cost of the primitive operations the allreduce schedules are made of, on forced CPU devices.

    python benchmarks/cpu_primitives.py --devices 8 --mib 16

Explains the ratios of `jaxdist bench allreduce` on one CPU (benchmarks/results/
NOTES_collectives_cpu.md, "What limits each schedule on one CPU"): how much a psum costs next
to one ppermute, a chain of small ppermutes, writing an output and zero-filling a
buffer, next to the ring allreduce built from them. Each operation runs per device inside
the same shard_map harness the benchmark uses; the operations are timed in interleaved rounds
and medians are printed. A second pass runs each operation alone and reports the processor
time it took per call (user and system, all threads): the devices are threads sharing the
cores, so an operation that keeps every core busy costs its processor time divided by the
cores, whatever its schedule.
"""

from __future__ import annotations

import argparse
import os
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mib", type=int, default=16, help="MiB per device")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist import meshes
    from jaxdist.comm import collectives

    p = args.devices
    n = args.mib * 2**20 // 4
    mesh = meshes.ring(p)
    x = jax.device_put(
        np.random.default_rng(0).standard_normal((p, n)).astype(np.float32),
        NamedSharding(mesh, P("x")),
    )
    shift = [(j, (j + 1) % p) for j in range(p)]

    def chain(v):
        block = v[: n // p]
        for _ in range(p - 1):
            block = lax.ppermute(block, "x", shift)
        return block

    operations = {
        f"psum of {args.mib} MiB": lambda v: lax.psum(v, "x"),
        f"one ppermute of {args.mib} MiB": lambda v: lax.ppermute(v, "x", shift),
        f"{p - 1} chained ppermutes of {args.mib}/{p} MiB": chain,
        f"return {args.mib} MiB unchanged (write the output)": lambda v: v,
        f"zero-fill a fresh {args.mib} MiB buffer": lambda v: jnp.zeros_like(v).at[0].set(v[0]),
        f"scale {args.mib} MiB by 2 (one elementwise pass)": lambda v: v * 2,
        f"ring reduce-scatter of {args.mib} MiB (jaxdist)": lambda v: collectives.reduce_scatter(
            v, "x"
        ),
        f"ring allreduce of {args.mib} MiB (jaxdist)": lambda v: collectives.allreduce(
            v, "x", algorithm="ring"
        ),
    }
    compiled = {
        name: jax.jit(
            jax.shard_map(
                lambda v, op=op: op(v[0])[None], mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )
        )
        for name, op in operations.items()
    }
    for fn in compiled.values():
        jax.block_until_ready(fn(x))
    runners = {name: (lambda fn=fn: fn(x)) for name, fn in compiled.items()}
    time_and_print(runners, args.rounds, f"{p} CPU devices, {args.mib} MiB per device")


def time_and_print(runners: dict, rounds: int, what: str) -> None:
    """Time ``runners`` in interleaved rounds, then each alone for its processor time, and
    print one row per runner: median wall, mean user and system milliseconds per call."""
    from jaxdist.bench import timing

    times = timing.interleaved_rounds(runners, steps=1, rounds=rounds)
    cpu = {name: processor_time(run, rounds) for name, run in runners.items()}
    print(
        f"# {what} on {os.cpu_count()} cores; wall: median of {rounds} interleaved rounds; "
        f"processor time: mean per call"
    )
    print(f"{'operation':<48s} {'wall ms':>8s} {'user ms':>8s} {'sys ms':>8s}")
    for name, ts in times.items():
        user, system = cpu[name]
        print(f"{name:<48s} {statistics.median(ts) * 1e3:8.2f} {user:8.2f} {system:8.2f}")


def processor_time(run, calls: int) -> tuple[float, float]:
    """Mean user and system processor milliseconds per call of ``run`` (all threads)."""
    import resource

    import jax

    jax.block_until_ready(run())
    start = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        jax.block_until_ready(run())
    end = resource.getrusage(resource.RUSAGE_SELF)
    return (
        (end.ru_utime - start.ru_utime) * 1e3 / calls,
        (end.ru_stime - start.ru_stime) * 1e3 / calls,
    )


if __name__ == "__main__":
    main()
