"""Time single ``ppermute`` patterns across processes, to see what limits the schedules.

Run it once per process, e.g. on the emulated cluster::

    sudo jaxdist cluster --hosts 4 --devices-per-host 1 --bandwidth 1gbit -- \\
        python benchmarks/ppermute_patterns.py --sizes 1K,1M,16M

Every schedule in :mod:`jaxdist.comm.collectives` is a chain of ``ppermute`` steps; over gloo each
step is one rendezvous-then-send per (source, target) pair. This script times the building
blocks one at a time on a flat 1-D mesh of all devices, ``size`` bytes per device:

* ``shift``: every device sends to ``i + 1`` (one ring step, all links busy one way);
* ``swap1`` / ``swap2``: every device swaps with ``i XOR 1`` / ``i XOR 2`` (a 2-device ring
  step, and a halving-doubling step): both directions of one connection busy;
* ``one_way``: only even devices send, to ``i + 1`` (half the links idle);
* ``shift_x4``: four dependent shifts of ``size / 4`` each: the same bytes as ``shift`` in
  four steps, so the difference is the per-step overhead;
* ``swap1_split``: ``swap1`` as two independent one-way ppermutes (do they overlap?);
* ``compute`` / ``shift_and_compute``: an elementwise computation of the buffer alone, and the
  same computation beside a ``shift`` it does not depend on (does computation overlap a
  transfer? If it does, the second takes about as long as the slower of the first two);
* ``psum``: gloo's own allreduce of ``size`` bytes, for scale.

On two processes with ``L >= 2`` devices each (device ``j = h * L + k``), four more patterns
time the two-host steps of ``hierarchical``; MB/s is per *host* link and
direction (``L`` devices' bytes):

* ``host_swap``: ``(0, k) <-> (1, k)``: every device swaps with its partner on the other host;
* ``host_crossed``: ``(0, k) -> (1, k)`` and ``(1, k) -> (0, k + 1)``: the same bytes per
  host, but no pair of devices sends both ways;
* ``in_host_ring``: a ring allreduce inside each host only (``hierarchical``'s intra-host
  reduce-scatter and all-gather, without the step between hosts); MB/s is its busbw;
* ``in_host_native``: the same with gloo's own allreduce (psum over the host's devices).

Prints one line per (pattern, size) from process 0: median seconds and the MB/s each device's
link carried (bytes sent per device / time); ``--json PATH`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.bench import allreduce as bench
from jaxdist.bench import sizes
from jaxdist.comm import collectives
from jaxdist.runtime import distributed


def patterns(
    p: int, processes: int = 1
) -> dict[str, tuple[Callable[[jax.Array], jax.Array] | None, float]]:
    """name -> (per-device body, bytes counted per link as a multiple of the buffer); the
    ``in_host_*`` patterns have no body here, :func:`in_host` builds them on their own mesh."""

    def perm(pairs: list[tuple[int, int]]) -> Callable[[jax.Array], jax.Array]:
        return lambda v: lax.ppermute(v, "x", pairs)

    def shift_x4(v: jax.Array) -> jax.Array:
        parts = jnp.split(v, 4)
        out = []
        carry = jnp.zeros_like(parts[0])
        for part in parts:  # each step depends on the previous, like a ring's steps
            carry = lax.ppermute(part + carry, "x", [(j, (j + 1) % p) for j in range(p)])
            out.append(carry)
        return jnp.concatenate(out)

    def swap_split(v: jax.Array) -> jax.Array:
        # swap1 as two independent one-way ppermutes: each pair's directions in separate calls
        forward = lax.ppermute(v, "x", [(j, j + 1) for j in range(0, p, 2)])
        backward = lax.ppermute(v, "x", [(j + 1, j) for j in range(0, p, 2)])
        return forward + backward

    def compute(v: jax.Array) -> jax.Array:
        # One fused loop of transcendental math: about as long as a ring step's transfer
        # of a few MiB on these cores, and no memory traffic beyond one read and one write.
        w = v
        for _ in range(2):
            w = jnp.sin(w) * 1.0001 + 0.5
        return w

    def shift_and_compute(v: jax.Array) -> jax.Array:
        return lax.ppermute(v, "x", [(j, (j + 1) % p) for j in range(p)]) + compute(v)

    found = {
        "shift": (perm([(j, (j + 1) % p) for j in range(p)]), 1.0),
        "swap1": (perm([(j, j ^ 1) for j in range(p)]), 1.0),
        "one_way": (perm([(j, j + 1) for j in range(0, p, 2)]), 1.0),
        "swap1_split": (swap_split, 1.0),
        "shift_x4": (shift_x4, 1.0),
        "compute": (lambda v: v + compute(v), 1.0),
        "shift_and_compute": (shift_and_compute, 1.0),
        "psum": (lambda v: lax.psum(v, "x"), 2 * (p - 1) / p),
    }
    if p >= 4:
        found["swap2"] = (perm([(j, j ^ 2) for j in range(p)]), 1.0)
    local = p // processes
    if processes == 2 and local >= 2:
        found["host_swap"] = (perm([(j, (j + local) % p) for j in range(p)]), float(local))
        crossed = [(k, local + k) for k in range(local)]
        crossed += [(local + k, (k + 1) % local) for k in range(local)]
        found["host_crossed"] = (perm(crossed), float(local))
        found["in_host_ring"] = (None, 2 * (local - 1) / local)  # see in_host()
        found["in_host_native"] = (None, 2 * (local - 1) / local)
    return found


def in_host(algorithm: str, local: int, x: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """``algorithm``'s allreduce over the ``local`` axis of a two-host hierarchical mesh,
    taking the flat ``(p, n)`` input of the other patterns."""
    mesh = meshes.hierarchical(2, local)
    spec = P(("host", "local"))

    def body(v):
        return collectives.allreduce(v[0], "local", algorithm)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    placed = jax.device_put(x, NamedSharding(mesh, spec))  # once, outside the timing
    return lambda _: fn(placed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1K,1M,16M", help="bytes per device, e.g. 1K,16M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    distributed.initialize()
    p = jax.device_count()
    mesh = meshes.ring(p)
    leader = jax.process_index() == 0
    rows = []
    for nbytes in sizes.parse_sizes(args.sizes):
        x = bench.make_input(mesh, nbytes // 4, np.float32, seed=0)
        for name, (body, sent) in patterns(p, jax.process_count()).items():
            if name.startswith("in_host_"):
                fn = in_host(name.removeprefix("in_host_"), p // jax.process_count(), x)
            else:
                fn = bench.per_device(mesh, body)
            jax.block_until_ready(fn(x))  # compile and warm up
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                jax.block_until_ready(fn(x))
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rate = sent * nbytes / seconds / 1e6
            rows.append({"pattern": name, "nbytes": nbytes, "seconds": seconds, "MB_per_s": rate})
            if leader:
                print(
                    f"{sizes.format_size(nbytes):>6s} {name:<14s} {seconds * 1e3:9.2f} ms "
                    f"{rate:8.1f} MB/s per link",
                    flush=True,
                )
    if leader and args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": p, "processes": jax.process_count(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
