"""A pairwise exchange (device i <-> i XOR 1) sent whole and in pieces, across emulated hosts.

Run on the emulated cluster::

    sudo jaxdist cluster --hosts 2 --devices-per-host 1 --bandwidth 1gbit -- \\
        python benchmarks/exchange_pieces.py --mib 16 --pieces none,1M,512K,256K,128K,64K

Over gloo a swap sent as one message runs one direction after the other (XLA posts the send
before the receive, and gloo queues the later device's "ready to receive" notice behind its
own payload; benchmarks/results/NOTES_emulated_hosts.md, section 4.1). ``jaxdist.comm.collectives.permute``
sends an exchange as consecutive pieces of at most ``exchange_piece_bytes``. Process 0 prints,
per piece size, the median time of ``--iters`` exchanges and the rate of each direction; the
piece sizes are timed in interleaved rounds (``jaxdist.bench.timing.interleaved_rounds``), so
machine noise falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB each device sends (default 16)")
    parser.add_argument(
        "--pieces",
        default="none,1M,512K,256K,128K,64K",
        help="comma-separated piece sizes; 'none' sends the exchange whole",
    )
    parser.add_argument("--iters", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--json", help="write the results here (process 0)")
    args = parser.parse_args()

    import jax
    import numpy as np

    from jaxdist import meshes
    from jaxdist.bench import allreduce as bench
    from jaxdist.bench import sizes, timing
    from jaxdist.comm import collectives
    from jaxdist.runtime import distributed

    distributed.initialize()
    p = jax.device_count()
    if p % 2:
        raise SystemExit(f"exchange_pieces.py: needs an even number of devices, found {p}")
    mesh = meshes.ring(p)
    perm = [(j, j ^ 1) for j in range(p)]
    pieces = {
        text: None if text == "none" else sizes.parse_size(text) for text in args.pieces.split(",")
    }
    x = bench.make_input(mesh, (args.mib << 20) // 4, np.float32, seed=0)
    fns = {
        text: bench.per_device(
            mesh, lambda v, b=b: collectives.permute(v, "x", perm, exchange_piece_bytes=b)
        )
        for text, b in pieces.items()
    }
    expected = None
    for text, fn in fns.items():  # compile, warm up, and check every form moves the same data
        out = np.asarray(jax.device_get(fn(x).addressable_shards[0].data))
        expected = out if expected is None else expected
        if not np.array_equal(out, expected):
            raise SystemExit(f"exchange_pieces.py: pieces of {text} delivered different data")
    runners = {text: (lambda fn=fn: fn(x)) for text, fn in fns.items()}
    times = timing.interleaved_rounds(runners, steps=1, rounds=args.iters)
    if jax.process_index() != 0:
        return
    rows = []
    for text, ts in times.items():
        median = statistics.median(ts)
        rate = (args.mib << 20) / median / 1e6
        rows.append({"piece": text, "seconds": median, "mb_per_s_each_way": rate})
        print(
            f"exchange of {args.mib} MiB, pieces {text:>5s}: {median * 1e3:8.1f} ms, "
            f"{rate:6.1f} MB/s each way",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": p, "mib": args.mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
