"""Collectives over gloo before and after a reduce-scatter: jaxdist's ``native`` one, then XLA's.

Run on CPU devices in several processes::

    jaxdist launch --processes 2 --devices-per-process 2 -- \\
        python benchmarks/gloo_reduce_scatter.py --mib 16 --json gloo_reduce_scatter.json

Once gloo's own reduce-scatter (``lax.psum_scatter``) has run in a process, that process's later
collectives on large buffers run far slower. ``jaxdist.comm.collectives.reduce_scatter(...,
"native")`` therefore sends an all-reduce over gloo and keeps this device's chunk. Process 0
prints the median time of ``--iters`` calls of XLA's ``psum`` and of the ring's allreduce on
``--mib`` MiB per device at three moments: fresh, after jaxdist's native reduce-scatter, and
after XLA's ``psum_scatter`` (which cannot be undone, so it comes last).
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB per device (default 16)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls (default 3)")
    parser.add_argument("--json", help="write the results here (process 0)")
    args = parser.parse_args()

    import jax
    import numpy as np
    from jax import lax

    from jaxdist import meshes
    from jaxdist.bench import allreduce as bench
    from jaxdist.bench import timing
    from jaxdist.comm import collectives
    from jaxdist.runtime import distributed

    distributed.initialize()
    if not collectives.wire.over_gloo():
        raise SystemExit("gloo_reduce_scatter.py: needs CPU devices in several processes (gloo)")
    p = jax.device_count()
    mesh = meshes.ring(p)
    x = bench.make_input(mesh, (args.mib << 20) // 4, np.float32, seed=0)
    small = bench.make_input(mesh, 1024 * p, np.float32, seed=1)
    timed = {
        "psum": bench.per_device(mesh, lambda v: lax.psum(v, "x")),
        "ring allreduce": bench.per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring")),
    }
    scatters = {
        "after jaxdist's native reduce-scatter": bench.per_device(
            mesh, lambda v: collectives.reduce_scatter(v, "x", "native")
        ),
        "after XLA's psum_scatter": bench.per_device(
            mesh, lambda v: lax.psum_scatter(v, "x", tiled=True)
        ),
    }
    rows = []

    def measure(moment: str) -> None:
        for name, fn in timed.items():
            jax.block_until_ready(fn(x))  # compiled and warm
            seconds = timing.interleaved_rounds({name: lambda fn=fn: fn(x)}, 1, args.iters)[name]
            rows.append(
                {"moment": moment, "collective": name, "seconds": statistics.median(seconds)}
            )

    measure("fresh")
    for moment, scatter in scatters.items():
        jax.block_until_ready(scatter(small))
        measure(moment)
    if jax.process_index() != 0:
        return
    for row in rows:
        print(
            f"{row['moment']:>38s}: {row['collective']:<14s} of {args.mib} MiB "
            f"{row['seconds'] * 1e3:9.1f} ms",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"devices": p, "processes": jax.process_count(), "mib": args.mib, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
