"""``jaxdist mesh show|list|cost``: inspect mesh presets, validate them against the devices,
and price every allreduce on them with the cost model."""

from __future__ import annotations

import argparse
import sys

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    mesh = subparsers.add_parser("mesh", help="inspect device meshes")
    actions = mesh.add_subparsers(dest="mesh_action", metavar="ACTION")
    show = actions.add_parser(
        "show", help="print a mesh's layout and check it fits the devices present"
    )
    show.add_argument(
        "spec", metavar="NAME|PATH", help="preset name (see `jaxdist mesh list`) or TOML path"
    )
    show.set_defaults(func=show_mesh)
    listing = actions.add_parser("list", help="list the mesh presets")
    listing.set_defaults(func=list_meshes)
    cost = actions.add_parser(
        "cost",
        help="predict every allreduce's time on a mesh from its links (no devices needed)",
        description="Price every allreduce schedule on a mesh (a planning preset of thousands "
        "of devices included) with the alpha-beta cost model, for links you describe. On a "
        "two-axis mesh --link is the outer axis's link and --inner-link the inner axis's; the "
        "one-axis schedules cross both and run at the outer links' pace.",
    )
    cost.add_argument("spec", metavar="NAME|PATH", help="preset name or TOML path")
    cost.add_argument(
        "--bytes", default="100M", help="bytes per device: a,b,c or LO:HI (default 100M)"
    )
    cost.add_argument(
        "--link",
        required=True,
        metavar="LATENCY:BANDWIDTH",
        help="each device's link (the outer axis on two-axis meshes), e.g. 5us:12.5GB/s",
    )
    cost.add_argument(
        "--inner-link",
        metavar="LATENCY:BANDWIDTH",
        help="links along the inner axis of a two-axis mesh (default: --link)",
    )
    cost.add_argument(
        "--ports",
        type=int,
        default=1,
        help="messages a device sends at full rate at once over --link (default 1; 2 where it "
        "has a link to each ring neighbour, as on a TPU torus)",
    )
    cost.add_argument(
        "--inner-ports", type=int, default=None, help="the same for --inner-link (default --ports)"
    )
    cost.add_argument("--algorithms", default="all", help="comma-separated names, or 'all'")
    cost.add_argument(
        "--inter-algorithm",
        default=None,
        help="hierarchical: schedule across the outer axis (default ring)",
    )
    cost.set_defaults(func=cost_on_mesh)


def list_meshes(args: argparse.Namespace) -> int:
    from jaxdist import meshes

    for name in meshes.presets():
        spec = meshes.load(name)
        shape = " x ".join(f"{n}={s}" for n, s in spec.axes)
        print(f"{name:<20s} {spec.layout:<13s} {shape:<22s} {spec.size:>6d} devices")
    return 0


def show_mesh(args: argparse.Namespace) -> int:
    from jaxdist import meshes

    try:
        spec = meshes.load(args.spec)
    except meshes.MeshSpecError as err:
        print(f"jaxdist mesh: {err}", file=sys.stderr)
        return 2
    try:
        print(meshes.describe(spec))
    except meshes.MeshDoesNotFitError as err:
        print(meshes.summary(spec))
        print(f"jaxdist mesh: {err}", file=sys.stderr)
        return 1
    return 0


def _cost_inputs(args: argparse.Namespace):
    """(spec, sizes, network, algorithms, inter_algorithm) of ``mesh cost``; ValueError (or
    MeshSpecError) naming the bad argument."""
    from jaxdist import meshes
    from jaxdist.bench.sizes import parse_sizes
    from jaxdist.cli.bench import check_inter_algorithm, parse_algorithms
    from jaxdist.comm import cost_model

    spec = meshes.load(args.spec)
    if spec.layout == "pipeline":
        raise ValueError(
            f"{spec.name} is a pipeline mesh: its allreduces run over the data axes alone; "
            f"price them on the data-parallel preset of that shape"
        )
    if len(spec.shape) == 1:
        inner_only = {
            "--inner-link": args.inner_link,
            "--inner-ports": args.inner_ports,
            "--inter-algorithm": args.inter_algorithm,
        }
        given = [flag for flag, value in inner_only.items() if value is not None]
        if given:
            raise ValueError(
                f"only a two-axis mesh takes {', '.join(given)}; {spec.name} has one axis "
                f"({spec.axis_names[0]}={spec.size})"
            )
    if spec.size < 2:
        raise ValueError(f"{spec.name} has one device: there is nothing to allreduce")
    sizes = parse_sizes(args.bytes)
    if min(sizes) < 1:
        raise ValueError(f"--bytes must be at least 1 byte per device, got {args.bytes!r}")
    inter_algorithm = args.inter_algorithm or "ring"
    check_inter_algorithm(inter_algorithm)
    outer = cost_model.parse_link(args.link, args.ports)
    inner_ports = args.ports if args.inner_ports is None else args.inner_ports
    inner = cost_model.parse_link(args.inner_link or args.link, inner_ports)
    network = cost_model.Network(intra=inner, inter=outer) if len(spec.shape) == 2 else outer
    return spec, sizes, network, parse_algorithms(args.algorithms), inter_algorithm


def cost_on_mesh(args: argparse.Namespace) -> int:
    from jaxdist import meshes
    from jaxdist.bench.sizes import format_size
    from jaxdist.comm import cost_model

    try:
        spec, sizes, network, algorithms, inter_algorithm = _cost_inputs(args)
    except (meshes.MeshSpecError, ValueError) as err:
        print(f"jaxdist mesh cost: {err}", file=sys.stderr)
        return 2
    print(f"# predicted allreduce times on {spec.name}: {spec.layout}, {spec.size} devices")
    if isinstance(network, cost_model.Network):
        (outer_name, outer_size), (inner_name, inner_size) = spec.axes
        flat_on = "outer" if outer_size > 1 else "inner"
        print(f"# inner axis {inner_name}={inner_size}: {_describe(network.intra)}")
        print(f"# outer axis {outer_name}={outer_size}: {_describe(network.inter)}")
        print(f"# one-axis schedules run on every device, at the {flat_on} axis's pace")
    else:
        print(f"# links: {_describe(network)}")
    print(
        f"{'size':>8s} {'algorithm':<20s} {'time(us)':>13s} {'algbw(GB/s)':>11s} "
        f"{'busbw(GB/s)':>11s} {'x best':>7s}"
    )
    skipped: dict[str, str] = {}
    for nbytes in sizes:
        predicted = cost_model.predict_all(
            nbytes, spec.shape, network, algorithms, inter_algorithm=inter_algorithm
        )
        times = {a: t for a, t in predicted.items() if isinstance(t, float)}
        skipped.update({a: t for a, t in predicted.items() if isinstance(t, str)})
        best = min(times.values(), default=None)
        for algorithm, seconds in times.items():
            algbw, busbw = cost_model.bus_bandwidth(nbytes, seconds, spec.size)
            print(
                f"{format_size(nbytes):>8s} {algorithm:<20s} {seconds * 1e6:13.1f} "
                f"{algbw / 1e9:11.3f} {busbw / 1e9:11.3f} {seconds / best:7.2f}"
            )
    for algorithm, reason in skipped.items():
        print(f"# skipped {algorithm}: {reason}")
    return 0


def _describe(link) -> str:
    return (
        f"alpha {link.alpha * 1e6:g} us, {link.bandwidth / 1e9:g} GB/s, "
        f"{link.ports} port(s) per device"
    )
