"""Where the torus2d allreduce's time goes on forced CPU devices, for both orders of its axes.

    python benchmarks/torus2d_phases.py --mib 16

On ``torus-4x2`` (axes ``y`` of 4, ``x`` of 2) ``allreduce(v, ("y", "x"), "torus2d")``
reduce-scatters along ``x``, an axis of two, and ``("x", "y")`` along ``y``, an axis of four.
This times both next to psum and the flat ring of 8 and next to the textbook three-phase
form of the first order built from the public building blocks (reduce-scatter over ``x``,
ring allreduce over ``y``, all-gather over ``x``), which the schedule replaced on an inner
axis of two by one that exchanges each block of the outer ring across the pair as it
arrives (``collectives.torus2d.torus_pair_allreduce``). All five run as a mean, with the input
donated, as a train step hands over its gradient buckets, so the result of one call is the
input of the next. Then the three phases on their own and the operations they are made of:
a swap of half the buffer, the copy of the slice it sends, the addition, the final
concatenation. Medians of interleaved rounds (``jaxdist.bench.timing``), then
the processor time per call of each, all threads, as in ``cpu_primitives.py``.
Phase 2 runs as a mean, so that its chained donated calls keep their values bounded, and
phase 3 without the division; in the schedule phase 2 is a sum and phase 3 divides as it
writes, so the phases differ from it only in where one fused division happens.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB per device")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax.numpy as jnp
    import numpy as np
    from cpu_primitives import time_and_print
    from jax import lax

    from jaxdist import meshes
    from jaxdist.bench import allreduce as bench
    from jaxdist.bench import timing
    from jaxdist.comm import collectives

    mesh = meshes.build("torus-4x2")
    axes = tuple(mesh.axis_names)  # ("y", "x")
    n = args.mib * 2**20 // 4
    half = n // 2
    swap = [(0, 1), (1, 0)]

    mib, hmib = args.mib, args.mib / 2
    # name: (elements per device of the input, body, donated: the output feeds the next call)
    operations = {
        "pmean over both axes": (n, lambda v: lax.pmean(v, axes), True),
        "ring mean over all 8": (
            n,
            lambda v: collectives.allreduce(v, axes, "ring", op="mean"),
            True,
        ),
        "torus2d mean, (y, x): inner axis of 2": (
            n,
            lambda v: collectives.allreduce(v, axes, "torus2d", op="mean"),
            True,
        ),
        "torus2d mean, (x, y): inner axis of 4": (
            n,
            lambda v: collectives.allreduce(v, ("x", "y"), "torus2d", op="mean"),
            True,
        ),
        "three phases in turn, (y, x)": (
            n,
            lambda v: collectives.all_gather(
                collectives.allreduce(collectives.reduce_scatter(v, "x"), "y", "ring"),
                "x",
                divisor=8,
            ),
            True,
        ),
        f"phase 1: reduce-scatter over x, {mib} -> {hmib:g} MiB": (
            n,
            lambda v: collectives.reduce_scatter(v, "x"),
            False,
        ),
        f"phase 2: ring mean over y of {hmib:g} MiB": (
            half,
            lambda v: collectives.allreduce(v, "y", "ring", op="mean"),
            True,
        ),
        f"phase 3: all-gather over x, {hmib:g} -> {mib} MiB": (
            half,
            lambda v: collectives.all_gather(v, "x"),
            False,
        ),
        f"swap of a {hmib:g} MiB buffer": (half, lambda v: lax.ppermute(v, "x", swap), False),
        f"swap of the {hmib:g} MiB half of a buffer": (
            n,
            lambda v: lax.ppermute(v[half:], "x", swap),
            False,
        ),
        f"add two {hmib:g} MiB halves": (n, lambda v: v[:half] + v[half:], False),
        f"concatenate a {hmib:g} MiB buffer and its double": (
            half,
            lambda v: jnp.concatenate([v, v * 2]),
            False,
        ),
    }
    inputs = {
        size: bench.make_input(mesh, size, np.float32, seed=0)
        for size in {size for size, _, _ in operations.values()}
    }
    state = {}
    runners = {}
    for name, (size, body, donate) in operations.items():
        fn = bench.per_device(mesh, body, donate)
        if donate:
            state[name] = jnp.copy(inputs[size])

            def run(fn=fn, name=name):
                state[name] = fn(state[name])
                return state[name]
        else:

            def run(fn=fn, x=inputs[size]):
                return fn(x)

        runners[name] = run
    timing.warm_up(runners, warmup=1)
    time_and_print(runners, args.rounds, f"torus-4x2, 8 CPU devices, {mib} MiB per device")


if __name__ == "__main__":
    main()
