"""``jaxdist launch``: run a command as N processes of one JAX run on this machine."""

from __future__ import annotations

import argparse

from jaxdist.runtime import launch

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def command_after_dashes(rest: list[str]) -> list[str]:
    """The command given after ``--`` (argparse keeps the separator in a REMAINDER)."""
    return rest[1:] if rest[:1] == ["--"] else rest


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a command as N local processes of one JAX run",
        description="Start N copies of COMMAND with JAXDIST_COORDINATOR (a free port on "
        "127.0.0.1), JAXDIST_NUM_PROCESSES and JAXDIST_PROCESS_ID set, label each output line "
        "with [p<id>], and stop them all when one fails. Example: "
        "jaxdist launch --processes 2 --devices-per-process 2 -- jaxdist bench allreduce",
    )
    parser.add_argument("--processes", type=int, required=True, metavar="N")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="force K CPU devices in each process (JAXDIST_LOCAL_DEVICES)",
    )
    add_supervision_arguments(parser)
    # The launcher itself is no member of the run it starts.
    parser.set_defaults(func=run, joins_process_group=False)


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    """``--timeout``, ``--grace`` and the command after ``--``: shared with ``jaxdist cluster``."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop everything and exit 124 after S seconds (default: no limit)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=launch.DEFAULT_GRACE_S,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)s)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def run(args: argparse.Namespace) -> int:
    command = command_after_dashes(args.command)
    if not command:
        print(
            "jaxdist launch: no command given; usage: jaxdist launch --processes N -- COMMAND ..."
        )
        return 2
    try:
        return launch.launch(
            command,
            args.processes,
            devices_per_process=args.devices_per_process,
            timeout_s=args.timeout,
            grace_s=args.grace,
        )
    except ValueError as err:
        print(f"jaxdist launch: {err}")
        return 2
