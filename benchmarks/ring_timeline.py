"""Where a ring allreduce across emulated hosts spends its time: one line per call, step by step.

gloo moves each ``ppermute`` over TCP with a 48-byte header and then the payload, so an
``strace`` of process 0's socket calls shows when each ring step's send started (the
``writev`` that carries a whole chunk) and when its receive completed (the ``recvfrom`` that
brings the received bytes up to a whole chunk). Run the ring under strace on process 0 only::

    sudo jaxdist cluster --hosts 4 --devices-per-host 1 --bandwidth 1gbit -- sh -c '\\
      if [ "$JAXDIST_PROCESS_ID" = 0 ]; then \\
        exec strace -f -ttt -e trace=writev,recvfrom,write -o /tmp/ring.strace \\
          python benchmarks/ring_timeline.py run --mib 16; \\
      else exec python benchmarks/ring_timeline.py run --mib 16; fi'
    python benchmarks/ring_timeline.py analyze /tmp/ring.strace --chunk-mib 4

``run`` times ``--iters`` ring allreduces of ``--mib`` MiB per device (out of place, or
``--in-place``) and writes ``ITER`` / ``DONE`` to stdout around each call, so the trace can
be cut into calls. ``analyze`` prints, per call, the gaps in milliseconds: ``S`` from the
previous event to a send starting, ``R`` from the previous event to a receive completing, and
``end`` from the last receive to the call returning. On a capped link a step whose ``R`` is
the chunk's time at the link rate ran at that rate; the ``S`` gaps are what the device did
between steps (add the received chunk, dispatch the next collective). strace slows process 0
a little, so totals here run above the benchmark's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

CALL = re.compile(
    r"^(?P<pid>\d+)\s+(?P<t>\d+\.\d+)\s+(?P<name>\w+)\((?P<fd>\d+),(?P<rest>.*)= (?P<ret>-?\d+)"
)
# With ``strace -f`` a call that another thread interrupts is printed in two lines.
UNFINISHED = re.compile(r"^(?P<pid>\d+)\s+\S+\s+(?P<name>\w+)\((?P<fd>\d+),(?P<rest>.*)<unfinished")
RESUMED = re.compile(
    r"^(?P<pid>\d+)\s+(?P<t>\d+\.\d+)\s+<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)= (?P<ret>-?\d+)"
)


def _calls(lines):
    """(time in ms, name, fd, argument text, return value) per completed system call."""
    pending: dict[str, tuple[str, str]] = {}
    for line in lines:
        if match := CALL.match(line):
            fd, rest = match["fd"], match["rest"]
        elif match := UNFINISHED.match(line):
            pending[match["pid"]] = (match["fd"], match["rest"])
            continue
        elif (match := RESUMED.match(line)) and match["pid"] in pending:
            fd, head = pending.pop(match["pid"])
            rest = head + match["rest"]
        else:
            continue
        yield float(match["t"]) * 1e3, match["name"], fd, rest, int(match["ret"])


def run(mib: int, iters: int, in_place: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist import meshes
    from jaxdist.bench import allreduce as bench
    from jaxdist.comm import collectives
    from jaxdist.runtime import distributed

    distributed.initialize()
    p = jax.device_count()
    mesh = meshes.ring(p)
    fn = bench.per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring"), donate=in_place)
    x = bench.make_input(mesh, (mib << 20) // 4, np.float32, seed=0)

    def fresh() -> jax.Array:  # a donated input is gone after the call
        return jax.block_until_ready(jnp.copy(x)) if in_place else x

    for _ in range(2):  # compile and warm up
        jax.block_until_ready(fn(fresh()))
    leader = jax.process_index() == 0
    times = []
    for _ in range(iters):
        xi = fresh()
        if leader:
            os.write(1, b"ITER\n")
        start = time.perf_counter()
        jax.block_until_ready(fn(xi))
        times.append(time.perf_counter() - start)
        if leader:
            os.write(1, b"DONE\n")
    if leader:
        median = statistics.median(times)
        busbw = (mib << 20) * 2 * (p - 1) / p / median / 1e6
        print(
            f"ring {mib} MiB on {p} devices: median {median * 1e3:.1f} ms, busbw {busbw:.1f} MB/s"
        )


def analyze(path: str, chunk_bytes: int) -> None:
    received = 0
    started = last = None
    gaps: list[str] = []
    with open(path) as f:
        for t, name, fd, rest, ret in _calls(f):
            if name == "write" and fd == "1" and '"ITER' in rest:
                started = last = t
                received, gaps = 0, []
            elif started is None or ret < 0:
                continue
            elif name == "write" and fd == "1" and '"DONE' in rest:
                gaps.append(f"end {t - last:.1f}")
                print(f"call {t - started:6.1f} ms | " + " ".join(gaps))
                started = None
            elif name == "writev" and f"iov_len={chunk_bytes}" in rest:
                gaps.append(f"S{t - last:.1f}")
                last = t
            elif name == "recvfrom" and ret != 48:  # 48 bytes: gloo's message header
                received += ret
                while received >= chunk_bytes:
                    gaps.append(f"R{t - last:.1f}")
                    last = t
                    received -= chunk_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="time ring allreduces, marking each call on stdout")
    run_parser.add_argument("--mib", type=int, default=16, help="MiB per device")
    run_parser.add_argument("--iters", type=int, default=8)
    run_parser.add_argument("--in-place", action="store_true", help="donate the input")
    analyze_parser = sub.add_parser("analyze", help="per-call step gaps from an strace log")
    analyze_parser.add_argument("trace")
    analyze_parser.add_argument("--chunk-mib", type=float, required=True, help="MiB per step")
    args = parser.parse_args()
    if args.command == "run":
        run(args.mib, args.iters, args.in_place)
    else:
        analyze(args.trace, int(args.chunk_mib * (1 << 20)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
