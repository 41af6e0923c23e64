"""``jaxdist mesh show|list``: inspect mesh presets and validate them against the devices."""

from __future__ import annotations

import argparse
import sys


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
