"""The ``jaxdist`` command line.

JAX reads ``XLA_FLAGS`` once, when its CPU backend starts, so ``--cpu-devices`` is applied here
before any subcommand (and with it JAX) is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# The command line is the interface; nothing here is for import.
__all__: list[str] = []

# Set to 1 to see the stack of an error that is otherwise reported in one line.
TRACEBACK_ENV = "JAXDIST_TRACEBACK"

# Subcommand modules; each defines ``register(subparsers)`` that adds its parser and sets
# ``func`` to a callable taking the parsed arguments and returning an exit code.
SUBCOMMANDS = (
    "jaxdist.cli.mesh",
    "jaxdist.cli.bench",
    "jaxdist.cli.launch",
    "jaxdist.cli.cluster",
    "jaxdist.cli.data",
    "jaxdist.cli.train",
    "jaxdist.cli.plan",
    "jaxdist.cli.pipeline",
    "jaxdist.cli.plot",
)


def force_cpu_devices(count: int) -> None:
    """Make JAX expose ``count`` CPU devices in this process (must run before JAX starts)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxdist",
        description="JAX-native sharded training toolkit.",
        epilog=f"Known errors print one line (exit 2: the command or config; 1: at run time); "
        f"{TRACEBACK_ENV}=1 shows their stack.",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="run on N forced CPU devices (sets XLA_FLAGS and JAX_PLATFORMS=cpu); "
        "for dry runs of meshes and schedules on a machine without accelerators",
    )
    group = parser.add_argument_group(
        "joining a multi-process run by hand (otherwise JAXDIST_* variables, SLURM, Open MPI, "
        "Kubernetes or a Cloud TPU VM are detected; see docs/multihost.md)"
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


_python_formatwarning = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """The toolkit's own warnings as one line; everyone else's as Python prints them."""
    if category.__module__.startswith("jaxdist"):
        return f"jaxdist: warning: {message}\n"
    return _python_formatwarning(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    warnings.formatwarning = _format_warning
    # Pre-parse only --cpu-devices so the environment is set before JAX is imported.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cpu-devices", type=int, default=None)
    # Only before "--": what follows is the command that `launch` / `cluster` run.
    known, _ = pre.parse_known_args(argv[: argv.index("--")] if "--" in argv else argv)
    if known.cpu_devices is not None:
        if known.cpu_devices < 1:
            print(f"jaxdist: --cpu-devices must be >= 1, got {known.cpu_devices}", file=sys.stderr)
            return 2
        force_cpu_devices(known.cpu_devices)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    failed = _join_run(args, known.cpu_devices)
    return failed if failed is not None else run_subcommand(args)


def _join_run(args: argparse.Namespace, cpu_devices: int | None) -> int | None:
    """Join the multi-process run this process belongs to before the subcommand starts JAX
    (the flags, JAXDIST_* variables from ``jaxdist launch`` / ``cluster``, or SLURM, Open MPI,
    ...; a no-op for one process). An exit code when that cannot be done, else None."""
    by_hand = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    given = [flag for flag, value in by_hand.items() if value is not None]
    if given and getattr(args, "joins_process_group", True):
        missing = [flag for flag, value in by_hand.items() if value is None]
        if missing:
            print(
                f"jaxdist: --coordinator, --num-processes and --process-id go together; "
                f"missing: {', '.join(missing)}",
                file=sys.stderr,
            )
            return 2
        from jaxdist.runtime import distributed

        overridden = [name for name in distributed.JAXDIST_ENV if os.environ.get(name)]
        if overridden:
            print(f"jaxdist: the flags override {', '.join(overridden)}", file=sys.stderr)
    if getattr(args, "joins_process_group", True):
        from jaxdist.runtime import distributed

        try:
            # The subcommand may say how the process found its peers (`jaxdist train` does).
            args.process_group = distributed.initialize(
                args.coordinator,
                args.num_processes,
                args.process_id,
                local_device_count=cpu_devices,
            )
        except distributed.DistributedInitError as err:
            print(f"jaxdist: {err}", file=sys.stderr)
            return 1
        group = args.process_group
        if group.is_multiprocess:
            from jaxdist.runtime.peer_output import quiet_peers

            quiet_peers(group.process_id or 0, group.num_processes or 1)
    elif given:
        print(
            f"jaxdist: {', '.join(given)}: this command does not join a run (launch and "
            f"cluster start and connect their own processes; data and plot run alone)",
            file=sys.stderr,
        )
        return 2
    return None


def run_subcommand(args: argparse.Namespace) -> int:
    """Run the parsed subcommand. An error the toolkit knows (its class has an ``exit_code``:
    2 for a bad command or config, 1 for a failure at run time) prints one line naming the
    problem and exits with that code; with ``JAXDIST_TRACEBACK=1`` it raises with its stack.
    Ctrl-C that reaches here (a second one during training, or one elsewhere) is one line and
    exit 130. Anything else is a bug and keeps its traceback."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(
            f"\njaxdist {args.command}: stopped by Ctrl-C; what was saved before it is kept",
            file=sys.stderr,
        )
        return 130
    except Exception as err:
        code = getattr(err, "exit_code", None)
        if code is None or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(f"jaxdist {args.command}: {err}", file=sys.stderr)
        return int(code)


if __name__ == "__main__":
    sys.exit(main())
