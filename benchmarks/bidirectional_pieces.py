"""The bidirectional ring across emulated hosts with its steps sent whole and in pieces.

Run on the emulated cluster::

    sudo jaxdist cluster --hosts 4 --devices-per-host 1 --bandwidth 1gbit -- \\
        python benchmarks/bidirectional_pieces.py --mib 16,64 --pieces none,256K,512K

Each link of the bidirectional ring carries its two rings' messages in opposite directions.
Sent whole over gloo, a step's message can still sit in the socket's send buffer when its
sender starts the next step towards its other neighbour, and two messages then share the
host's link (benchmarks/results/NOTES_emulated_hosts.md, section 4.1). ``jaxdist.comm.collectives`` therefore
sends the schedule's steps in pieces of ``exchange_piece_bytes``, as it sends exchanges.
This times the one-directional ring and the bidirectional ring with each piece size
(``none``: whole), as a mean with the input donated, as a train step calls them (each
call's result is the next call's input), in interleaved rounds (``jaxdist.bench.timing``).
Process 0 prints per size and variant the median, mean and longest call and the median's
busbw.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="16", help="comma-separated MiB per device (default 16)")
    parser.add_argument(
        "--pieces",
        default="none,256K,512K",
        help="comma-separated piece sizes for the bidirectional ring; 'none' sends steps whole",
    )
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds (default 11)")
    parser.add_argument("--json", help="write the results here (process 0)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jaxdist import meshes
    from jaxdist.bench import allreduce as bench
    from jaxdist.bench import timing
    from jaxdist.comm import collectives
    from jaxdist.runtime import distributed

    distributed.initialize()
    p = jax.device_count()
    if p < 3:
        raise SystemExit(f"bidirectional_pieces.py: needs at least 3 devices, found {p}")
    mesh = meshes.ring(p)
    variants = {"ring": ("ring", "auto")}
    for text in args.pieces.split(","):
        piece = None if text == "none" else bench.parse_size(text)
        variants[f"bidirectional, pieces {text}"] = ("bidirectional_ring", piece)
    rows = []
    for mib in (int(m) for m in args.mib.split(",")):
        x = bench.make_input(mesh, (mib << 20) // 4, np.float32, seed=0)
        expected = np.asarray(
            bench.per_device(mesh, lambda v: lax.pmean(v, "x"))(x).addressable_data(0)
        )
        state, runners = {}, {}
        for name, (algorithm, piece) in variants.items():

            def mean(v, a=algorithm, b=piece):
                return collectives.allreduce(v, "x", a, op="mean", exchange_piece_bytes=b)

            fn = bench.per_device(mesh, mean, donate=True)
            found = np.asarray(fn(jnp.copy(x)).addressable_data(0))
            if not np.allclose(found, expected, rtol=1e-5, atol=1e-6):
                raise SystemExit(f"bidirectional_pieces.py: {name} does not match pmean")
            state[name] = jnp.copy(x)

            def run(fn=fn, name=name, state=state):
                state[name] = fn(state[name])
                return state[name]

            runners[name] = run
        timing.warm_up(runners, warmup=1)
        times = timing.interleaved_rounds(runners, steps=1, rounds=args.rounds)
        for name, ts in times.items():
            median = statistics.median(ts)
            busbw = (mib << 20) / median * 2 * (p - 1) / p / 1e6
            rows.append(
                {
                    "mib": mib,
                    "variant": name,
                    "median_s": median,
                    "mean_s": statistics.mean(ts),
                    "max_s": max(ts),
                    "busbw_mb_per_s": busbw,
                }
            )
            if jax.process_index() == 0:
                print(
                    f"{mib:4d} MiB {name:<32s} median {median * 1e3:7.1f} ms, mean "
                    f"{statistics.mean(ts) * 1e3:7.1f}, max {max(ts) * 1e3:7.1f}; "
                    f"busbw {busbw:6.1f} MB/s",
                    flush=True,
                )
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump({"devices": p, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
