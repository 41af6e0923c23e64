"""Is a two-way exchange on one TCP connection slower than on two?  (Plain sockets, no JAX.)

Run on two emulated hosts::

    sudo jaxdist cluster --hosts 2 --devices-per-host 1 --bandwidth 1gbit -- \\
        python benchmarks/tcp_duplex.py --mbytes 16

Host 0 and host 1 each send ``--mbytes`` MB to the other, three ways:

* ``one_way``: only host 0 sends (one connection);
* ``duplex_1conn``: both send at once over one connection (what gloo does: one TCP
  connection per pair of ranks, so a ppermute swap ``i <-> i^1`` is this);
* ``duplex_2conn``: both send at once, each over its own connection.

Host 0 prints the time and MB/s per direction of each. It separates the network emulation
(tbf queues, TCP) from gloo's transport when a schedule's pairwise steps run slowly.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

PORT = 8590  # inside the emulated hosts' own namespaces: nothing else listens there


def _recv_exactly(conn: socket.socket, nbytes: int) -> None:
    view = memoryview(bytearray(1 << 20))
    left = nbytes
    while left:
        got = conn.recv_into(view, min(left, len(view)))
        if not got:
            raise ConnectionError("peer closed the connection early")
        left -= got


def _exchange(send_conn, recv_conn, payload: bytes, send: bool, receive: bool) -> float:
    """Send ``payload`` on one connection while receiving as much on another (threads)."""
    start = time.perf_counter()
    threads = []
    if send:
        threads.append(threading.Thread(target=send_conn.sendall, args=(payload,)))
    if receive:
        threads.append(threading.Thread(target=_recv_exactly, args=(recv_conn, len(payload))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _barrier(conn: socket.socket) -> None:
    conn.sendall(b"b")
    _recv_exactly(conn, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank = int(os.environ["JAXDIST_PROCESS_ID"])
    peer_host = os.environ["JAXDIST_HOST"].rsplit("-h", 1)[0] + f"-h{1 - rank}"
    payload = os.urandom(args.mbytes * 10**6)

    # Two connections, both opened by host 1 to host 0: a (control + "one connection") and b.
    if rank == 0:
        server = socket.create_server(("0.0.0.0", PORT))
        a, _ = server.accept()
        b, _ = server.accept()
    else:
        for _ in range(100):  # host 0 may not listen yet
            try:
                a = socket.create_connection((peer_host, PORT))
                break
            except OSError:
                time.sleep(0.1)
        b = socket.create_connection((peer_host, PORT))
    for conn in (a, b):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    cases = {
        # (send on, receive on, this host sends, this host receives)
        "one_way": (a, a, rank == 0, rank == 1),
        "duplex_1conn": (a, a, True, True),
        # host 0 sends on a and receives on b; host 1 the other way round
        "duplex_2conn": (a if rank == 0 else b, b if rank == 0 else a, True, True),
    }
    for name, (send_conn, recv_conn, send, receive) in cases.items():
        times = []
        for _ in range(args.repeats):
            _barrier(a)
            times.append(_exchange(send_conn, recv_conn, payload, send, receive))
        _barrier(a)
        best = min(times)
        if rank == 0:
            print(
                f"{name:<13s} {args.mbytes} MB per direction: {best * 1e3:8.1f} ms, "
                f"{len(payload) / best / 1e6:6.1f} MB/s per direction",
                flush=True,
            )


if __name__ == "__main__":
    main()
