"""``jaxdist cluster``: run a command on an emulated cluster of network-namespace hosts."""

from __future__ import annotations

import argparse
import sys

from jaxdist.cli.launch import add_supervision_arguments, command_after_dashes
from jaxdist.runtime import cluster

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="run a command on H emulated hosts with capped links (Linux, root)",
        description="Build one network namespace per host on a private bridge "
        f"({cluster.SUBNET}.0/24, inside the namespaces only), cap each host link with tc, run "
        "COMMAND once per host as one JAX run (like `jaxdist launch`), then remove it all. "
        "Example: jaxdist cluster --hosts 4 --bandwidth 1gbit -- jaxdist bench allreduce",
    )
    parser.add_argument("--hosts", type=int, default=None, metavar="H")
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        metavar="K",
        help="force K CPU devices in each host's process (JAXDIST_LOCAL_DEVICES)",
    )
    parser.add_argument(
        "--bandwidth",
        default="1gbit",
        metavar="RATE",
        help="each host link's rate, both directions, e.g. 1gbit, 100mbit or 12.5GB/s "
        "(default %(default)s; 'none' leaves links uncapped)",
    )
    parser.add_argument(
        "--latency",
        default="0",
        metavar="DELAY",
        help="delay added per host-to-host message, e.g. 100us (needs the kernel's netem; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help=f"remove namespaces and /etc/netns entries left by crashed runs "
        f"(names starting with {cluster.PREFIX!r}) and exit",
    )
    add_supervision_arguments(parser)
    parser.set_defaults(func=run, joins_process_group=False)


def run(args: argparse.Namespace) -> int:
    try:
        if args.cleanup:
            cluster.check_tools()
            removed = cluster.cleanup()
            print("removed: " + (", ".join(removed) if removed else "nothing (no leftovers)"))
            return 0
        command = command_after_dashes(args.command)
        if args.hosts is None or not command:
            print(
                "jaxdist cluster: usage: jaxdist cluster --hosts H [--devices-per-host K] "
                "[--bandwidth 1gbit] [--latency 0] -- COMMAND ...",
                file=sys.stderr,
            )
            return 2
        bandwidth = None if args.bandwidth.lower() in ("none", "0") else args.bandwidth
        return cluster.run_cluster(
            command,
            args.hosts,
            devices_per_host=args.devices_per_host,
            bandwidth=bandwidth,
            latency=args.latency,
            timeout_s=args.timeout,
            grace_s=args.grace,
        )
    except cluster.ClusterError as err:
        print(f"jaxdist cluster: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"jaxdist cluster: {err}", file=sys.stderr)
        return 2
