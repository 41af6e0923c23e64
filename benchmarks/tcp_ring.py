"""A ring of chained TCP exchanges between emulated hosts, without JAX or gloo.

Run on the emulated cluster::

    sudo jaxdist cluster --hosts 4 --devices-per-host 1 --bandwidth 1gbit -- \\
        python benchmarks/tcp_ring.py --mib 16

Every host keeps one connection to the next host on the ring. A *step* sends ``chunk``
bytes to the next host while receiving as many from the previous one, and the next step
starts when both are done: the dependency chain of a ring allreduce, with nothing else in
it (no additions, no collective runtime). Host 0 prints, for ``--mib`` MiB split into 1 step
and into ``H - 1`` and ``2 (H - 1)`` steps, the median time and the rate per link. If the
chained steps run as fast as one long transfer, the network emulation adds no per-step cost
and any per-step cost a schedule shows comes from above the sockets.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time

PORT = 8591  # inside the emulated hosts' own namespaces: nothing else listens there


def _receive(conn: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``conn``; MSG_WAITALL lets the kernel wait for every byte."""
    if conn.recv_into(into, len(into), socket.MSG_WAITALL) != len(into):
        raise ConnectionError("previous host closed the connection early")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB per host and call")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rank = int(os.environ["JAXDIST_PROCESS_ID"])
    hosts = int(os.environ["JAXDIST_NUM_PROCESSES"])
    prefix = os.environ["JAXDIST_HOST"].rsplit("-h", 1)[0]

    server = socket.create_server(("0.0.0.0", PORT))
    for _ in range(200):  # the next host may not listen yet
        try:
            to_next = socket.create_connection((f"{prefix}-h{(rank + 1) % hosts}", PORT))
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"host {rank}: the next host never accepted a connection")
    from_previous, _ = server.accept()
    for conn in (to_next, from_previous):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    total = args.mib << 20
    payload = memoryview(os.urandom(total))
    received = memoryview(bytearray(total))

    def step(nbytes: int) -> None:
        sender = threading.Thread(target=to_next.sendall, args=(payload[:nbytes],))
        sender.start()
        _receive(from_previous, received[:nbytes])
        sender.join()

    for steps in (1, hosts - 1, 2 * (hosts - 1)):
        chunk = total // steps
        times = []
        for _ in range(args.repeats):
            step(1)  # line the hosts up: nobody starts before its previous host did
            start = time.perf_counter()
            for _ in range(steps):
                step(chunk)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        if rank == 0:
            print(
                f"{args.mib} MiB in {steps:2d} chained steps of {chunk / 2**20:.2f} MiB: "
                f"{median * 1e3:7.1f} ms, {chunk * steps / median / 1e6:6.1f} MB/s per link, "
                f"{median / steps * 1e3:6.2f} ms per step",
                flush=True,
            )


if __name__ == "__main__":
    main()
