"""``jaxdist bench allreduce``: the collective benchmark."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND")
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
    p.add_argument("--inter-algorithm", default="ring", help="hierarchical: schedule across hosts")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw busbw against size (PNG)")
    p.add_argument("--quiet", action="store_true", help="no per-measurement progress lines")
    p.set_defaults(func=run_allreduce)


def run_allreduce(args: argparse.Namespace) -> int:
    import jax

    from jaxdist import bench, collectives, meshes

    algorithms = (
        collectives.ALGORITHMS
        if args.algorithms == "all"
        else tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    )
    unknown = [a for a in algorithms if a not in collectives.ALGORITHMS]
    if unknown:
        print(
            f"jaxdist bench: unknown algorithm(s) {unknown}; expected {collectives.ALGORITHMS}",
            file=sys.stderr,
        )
        return 2
    try:
        sizes = bench.parse_sizes(args.sizes, args.factor)
        spec = meshes.load(args.mesh)
        mesh = meshes.build(spec)
    except ValueError as err:
        print(f"jaxdist bench: {err}", file=sys.stderr)
        return 2
    leader = jax.process_index() == 0
    options = {"inter_algorithm": args.inter_algorithm}
    if args.transfer_dtype:
        options["transfer_dtype"] = args.transfer_dtype

    def progress(line: str) -> None:
        if leader and not args.quiet:
            print(line, file=sys.stderr, flush=True)

    if leader:
        print(
            f"# measuring {len(algorithms)} algorithm(s) x {len(sizes)} size(s) on {spec.name}",
            file=sys.stderr,
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
        progress=progress,
    )
    if leader:
        print(bench.format_table(result))
        if args.json:
            bench.save_json(result, args.json)
        if args.plot:
            bench.plot(result, args.plot)
    return 0
