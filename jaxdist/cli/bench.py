"""``jaxdist bench allreduce``: the collective benchmark."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    """``jaxdist bench allreduce|resnet|train-step``."""
    from jaxdist.cli import bench_resnet

    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND")
    _register_allreduce(kinds)
    bench_resnet.register_kind(kinds)
    _register_train_step(kinds)


def _register_allreduce(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "allreduce",
        help="time every allreduce schedule against psum (nccl-tests style)",
        description="Run each allreduce at each size on a mesh, check it against psum, and print "
        "time, algbw, busbw, the ratio to psum and the cost model's prediction.",
    )
    p.add_argument(
        "--mesh", default="ring-8", help="preset name or path to a mesh TOML (default ring-8)"
    )
    p.add_argument(
        "--sizes",
        default="4K:64M",
        help="bytes per device: LO:HI (geometric) or a,b,c (default 4K:64M)",
    )
    p.add_argument(
        "--factor", type=int, default=4, help="growth factor for LO:HI sizes (default 4)"
    )
    p.add_argument("--algorithms", default="all", help="comma-separated names, or 'all' (default)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--transfer-dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="send messages in this dtype (ppermute schedules and psum)",
    )
    _add_schedule_arguments(p)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw busbw against size (PNG)")
    p.add_argument("--quiet", action="store_true", help="no per-measurement progress lines")
    p.set_defaults(func=run_allreduce)


def _add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """How the schedules run and how the cost model prices them."""
    p.add_argument("--inter-algorithm", default="ring", help="hierarchical: schedule across hosts")
    p.add_argument(
        "--crossed-exchange",
        choices=("on", "off"),
        default=None,
        help="torus2d/hierarchical on an outer axis of two: send the two directions between "
        "the hosts over different device pairs (on) or as one exchange (off, the default)",
    )
    p.add_argument(
        "--exchange-piece",
        default="auto",
        metavar="BYTES|auto|none",
        help="largest message of a pairwise exchange (two devices sending to each other), "
        "e.g. 256K; 'none' sends each exchange whole; default 'auto' (pieces over gloo only)",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="donate the input so a schedule may write its result over it (as inside a train "
        "step); default: out of place, like nccl-tests' first columns",
    )
    p.add_argument(
        "--op",
        choices=("sum", "mean"),
        default="sum",
        help="reduce with a sum (default) or a mean, as a train step averages gradients; the "
        "mean is checked and timed against pmean",
    )
    p.add_argument(
        "--link-ports",
        type=int,
        default=None,
        metavar="N",
        help="cost model: messages a device sends at full rate at once (1: one NIC or memory "
        "bus; 2: a link to each ring neighbour); default 2 on TPU, 1 elsewhere",
    )
    p.add_argument(
        "--link-rate",
        metavar="RATE",
        default=None,
        help="each device's link rate per direction (e.g. 1gbit, 12.5GB/s): print busbw as a "
        "share of it; default: the rate `jaxdist cluster` set, else none",
    )


def _register_train_step(kinds: argparse._SubParsersAction) -> None:
    t = kinds.add_parser(
        "train-step",
        help="images/s of the jaxdist train step against a plain jit + pmean step",
        description="Train a small ResNet with cross-replica BatchNorm on a mesh with the plain "
        "data-parallel step and with jaxdist's TrainStep for each allreduce; report images/s, "
        "the ratio to the plain step, and the compute / communication split.",
    )
    t.add_argument(
        "--mesh", default="torus-4x2", help="preset name or TOML path (default torus-4x2)"
    )
    t.add_argument(
        "--algorithms", default="native,ring,torus2d", help="comma-separated allreduce names"
    )
    t.add_argument("--per-device-batch", type=int, default=16)
    t.add_argument("--image-size", type=int, default=32)
    t.add_argument("--width", type=int, default=16, help="ResNet-18 base width (default 16)")
    t.add_argument("--steps", type=int, default=3, help="steps per timed round")
    t.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    t.add_argument(
        "--bucket-mb", type=float, default=16.0, help="gradient bucket size in MiB (0: one bucket)"
    )
    t.add_argument("--json", metavar="PATH", help="write the results as JSON")
    t.add_argument(
        "--wait-free",
        action="store_true",
        help="also time each permute schedule paced beside the backward pass (wait_free=True), "
        "in the same rounds as the step that leaves the order to the compiler",
    )
    t.add_argument(
        "--show-schedule",
        metavar="ALGORITHM",
        help="instead of timing: compile the step with this allreduce and report where XLA "
        "scheduled the gradient collective-permutes among the backward convolutions",
    )
    t.add_argument(
        "--show-plan",
        metavar="ALGORITHM",
        help="instead of timing: print how the step averages each gradient with this allreduce "
        "(or auto): buckets, schedules, dense layers sent as sufficient factors, the cost "
        "model's predictions and the runner-up",
    )
    t.add_argument(
        "--links",
        help="LATENCY:BANDWIDTH or a `bench allreduce --json` file of this mesh, for --show-plan "
        "(auto needs it outside `jaxdist cluster`)",
    )
    t.add_argument(
        "--sfb-layers",
        default="",
        help="dense layers sent as sufficient factors for --show-plan: all, none or "
        "comma-separated module paths (default: none; with auto every dense layer is a "
        "candidate)",
    )
    t.add_argument(
        "--sharding",
        action="store_true",
        help="instead: time a transformer LM step replicated, as ZeRO-1, as FSDP with the "
        "first of --algorithms, and as XLA's own FSDP (jit + NamedSharding), with each one's "
        "state and peak memory per device",
    )
    t.add_argument("--layers", type=int, default=2, help="transformer blocks for --sharding")
    t.add_argument("--d-model", type=int, default=256, help="model width for --sharding")
    t.set_defaults(func=run_train_step)


def parse_algorithms(text: str) -> tuple[str, ...]:
    """``--algorithms``: ``"all"`` or comma-separated names; ValueError for an unknown one."""
    from jaxdist.comm import collectives

    if text == "all":
        return collectives.ALGORITHMS
    return collectives.check_names(tuple(a.strip() for a in text.split(",") if a.strip()))


def _algorithms_and_mesh(text: str, mesh_name: str):
    """Parse ``--algorithms`` and build ``--mesh``."""
    from jaxdist import meshes

    algorithms = parse_algorithms(text)
    spec = meshes.load(mesh_name)
    return algorithms, spec, meshes.build(spec)


def _leader_printer(enabled: bool):
    import jax

    def say(line: str) -> None:
        if enabled and jax.process_index() == 0:
            print(line, file=sys.stderr, flush=True)

    return say


def _exchange_piece(text: str) -> int | str | None:
    """``--exchange-piece``: ``auto``, ``none`` or a size such as ``256K``."""
    from jaxdist.bench.sizes import parse_size

    if text == "auto":
        return "auto"
    if text == "none":
        return None
    try:
        size = parse_size(text)
    except ValueError as err:
        raise ValueError(f"--exchange-piece: {err}, or 'auto' or 'none'") from None
    if size < 1:
        raise ValueError(f"--exchange-piece must be at least 1 byte, got {text!r}")
    return size


def check_inter_algorithm(name: str) -> None:
    """``--inter-algorithm``: a one-dimensional schedule; ValueError naming the choices."""
    from jaxdist.comm import collectives

    choices = collectives.one_dimensional()
    if name not in choices:
        raise ValueError(f"--inter-algorithm must be one of {choices}, got {name!r}")


def run_allreduce(args: argparse.Namespace) -> int:
    import jax

    from jaxdist.bench import allreduce as bench
    from jaxdist.bench import allreduce_report
    from jaxdist.bench.sizes import parse_sizes
    from jaxdist.comm import cost_model, emulated_link

    try:
        algorithms, spec, mesh = _algorithms_and_mesh(args.algorithms, args.mesh)
        sizes = parse_sizes(args.sizes, args.factor)
        exchange_piece = _exchange_piece(args.exchange_piece)
        if args.link_ports is not None and args.link_ports < 1:
            raise ValueError(f"--link-ports must be at least 1, got {args.link_ports}")
        check_inter_algorithm(args.inter_algorithm)
        link_rate = (
            cost_model.parse_rate(args.link_rate)
            if args.link_rate
            else emulated_link.link_rate_from_environment()
        )
    except ValueError as err:
        print(f"jaxdist bench: {err}", file=sys.stderr)
        return 2
    if link_rate and not args.link_rate and jax.local_device_count() > 1:
        # The emulated cluster caps each host's link, and this host's devices share it: a
        # device's busbw is not comparable to the host's rate.
        _leader_printer(True)(
            f"# link% left out: the {jax.local_device_count()} devices of each emulated host "
            f"share its link (give --link-rate to compare anyway)"
        )
        link_rate = None
    options = _schedule_options(args, exchange_piece)
    _leader_printer(True)(
        f"# measuring {len(algorithms)} algorithm(s) x {len(sizes)} size(s) on {spec.name}"
    )
    result = bench.run(
        mesh,
        sizes,
        algorithms,
        dtype=args.dtype,
        warmup=args.warmup,
        iters=args.iters,
        mesh_name=spec.name,
        options=options,
        in_place=args.in_place,
        op=args.op,
        ports=args.link_ports,
        link_rate=link_rate,
        progress=_leader_printer(not args.quiet),
    )
    if jax.process_index() == 0:
        print(allreduce_report.format_table(result))
        if args.json:
            allreduce_report.save_json(result, args.json)
            print(f"wrote {Path(args.json).resolve()}")
        if args.plot:
            allreduce_report.plot(result, args.plot)
            print(f"wrote {Path(args.plot).resolve()}")
    return 0


def _schedule_options(args: argparse.Namespace, exchange_piece: int | None) -> dict:
    """The schedules' options from the command line."""
    options = {"inter_algorithm": args.inter_algorithm, "exchange_piece_bytes": exchange_piece}
    if args.crossed_exchange is not None:
        options["crossed_exchange"] = args.crossed_exchange == "on"
    if args.transfer_dtype:
        options["transfer_dtype"] = args.transfer_dtype
    return options


def _run_sharding(args: argparse.Namespace, algorithm: str, mesh, leader: bool) -> int:
    import json

    from jaxdist.bench import sharding as bench_sharding

    try:
        results = bench_sharding.run(
            mesh,
            algorithm,
            num_layers=args.layers,
            d_model=args.d_model,
            per_device_batch=args.per_device_batch,
            steps=args.steps,
            rounds=args.rounds,
            progress=_leader_printer(True),
        )
    except ValueError as err:
        print(f"jaxdist bench: {err}", file=sys.stderr)
        return 2
    if leader:
        describe = (
            f"transformer LM, {args.layers} blocks of width {args.d_model}, "
            f"{args.per_device_batch} sequences of 128 bytes per device, AdamW"
        )
        print(bench_sharding.format_table(results, mesh, describe))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(bench_sharding.to_json(results), f, indent=2)
            print(f"wrote {Path(args.json).resolve()}")
    return 0


def run_train_step(args: argparse.Namespace) -> int:
    import json

    import jax

    from jaxdist.bench import train_step as bench_train

    try:
        algorithms, _, mesh = _algorithms_and_mesh(args.algorithms, args.mesh)
    except ValueError as err:
        print(f"jaxdist bench: {err}", file=sys.stderr)
        return 2
    leader = jax.process_index() == 0
    if args.sharding:
        return _run_sharding(args, algorithms[0], mesh, leader)
    if args.show_plan:
        from jaxdist.run.from_config import sfb_layers_setting

        try:
            plan = bench_train.gradient_plan(
                mesh,
                args.show_plan,
                links=args.links,
                sfb_layers=sfb_layers_setting(args.sfb_layers),
                bucket_bytes=int(args.bucket_mb * 2**20),
                width=args.width,
                per_device_batch=args.per_device_batch,
                image_size=args.image_size,
            )
        except (ValueError, FileNotFoundError) as err:
            print(f"jaxdist bench: {err}", file=sys.stderr)
            return 2
        if leader:
            print(
                f"# ResNet-18 (width {args.width}), {args.per_device_batch} images of "
                f"{args.image_size}x{args.image_size} per device, {mesh.size} devices, "
                f"allreduce {args.show_plan}"
            )
            print(plan.table())
        return 0
    if args.show_schedule:
        text, num_buckets = bench_train.compiled_step_hlo(
            mesh,
            args.show_schedule,
            bucket_bytes=int(args.bucket_mb * 2**20),
            width=args.width,
            per_device_batch=args.per_device_batch,
            image_size=args.image_size,
        )
        if leader:
            print(f"# {args.show_schedule} step, {num_buckets} gradient bucket(s)")
            for key, value in bench_train.schedule_summary(text).items():
                print(f"{key:<36s} {value}")
        return 0
    results = bench_train.run(
        mesh,
        algorithms,
        per_device_batch=args.per_device_batch,
        image_size=args.image_size,
        width=args.width,
        steps=args.steps,
        rounds=args.rounds,
        bucket_bytes=int(args.bucket_mb * 2**20),
        wait_free=args.wait_free,
        progress=_leader_printer(True),
    )
    if leader:
        print(bench_train.format_table(results, mesh, args.per_device_batch * mesh.size))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(bench_train.to_json(results), f, indent=2)
            print(f"wrote {Path(args.json).resolve()}")
    return 0
