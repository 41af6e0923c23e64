"""The mesh a recipe is planned on over a slice: its own when it has one device per chip,
otherwise its layout laid over the slice (``ring``: one axis of every chip; ``torus2d``: rows
along the slice's first dimension; ``torus3d``: the three dimensions of a v4 or v5p slice,
its first the inner axis; ``hierarchical``: rows of one host's chips)."""

from __future__ import annotations

from jaxdist import meshes
from jaxdist.aot.topology import Topology

__all__ = ["MeshMismatchError", "check_mesh_matches", "mesh_spec_for"]


class MeshMismatchError(ValueError):
    """A mesh given for a plan does not have one device per chip of the topology."""

    exit_code = 2


def mesh_spec_for(config_mesh: str, topology: Topology) -> tuple[meshes.MeshSpec, str]:
    """The mesh to plan on and a line saying where it came from (see the module docstring)."""
    chips = topology.num_chips
    base = meshes.load(config_mesh) if config_mesh else None
    if base is not None and base.size == chips:
        return base, f"the recipe's mesh {base.name!r}"
    layout = base.layout if base is not None else "ring"
    names = base.axis_names if base is not None else ("data",)
    inner = _inner_axis(layout, topology)
    if layout == "ring":
        axes = ((names[0], chips),)
    elif layout == "torus3d":
        axes = tuple(zip(names, _torus3d_axes(topology, base)))
    else:
        axes = ((names[0], chips // inner), (names[1], inner))
    spec = meshes.MeshSpec(
        f"{layout}-on-{topology.name}",
        layout,
        axes,
        devices_per_host=inner if layout == "hierarchical" else None,
    )
    if base is None:
        return spec, "one data axis over every chip (the recipe names no mesh)"
    return spec, (
        f"the recipe's {layout} layout over the slice (its mesh {base.name!r} has "
        f"{base.size} devices, the slice {chips} chips)"
    )


def _inner_axis(layout: str, topology: Topology) -> int:
    """Chips along the inner axis of a two-axis layout: a whole slice when several slices
    are joined by the data-centre network, and a host's GPUs (the outer axis crosses the
    host network); inside one TPU slice, a host's chips for ``hierarchical`` and a row of the
    torus for ``torus2d``."""
    if topology.network_groups > 1 or topology.is_gpu:
        return topology.chips_per_group
    return topology.chip.chips_per_host if layout == "hierarchical" else topology.shape[0]


def _torus3d_axes(topology: Topology, base: meshes.MeshSpec) -> tuple[int, ...]:
    """A 3-D torus over the dimensions of one TPU slice of three, outer to inner: the
    slice's last dimension outermost (``v4:8x8x16`` -> 16 x 8 x 8)."""
    if topology.is_gpu or topology.slices > 1 or len(topology.shape) != 3:
        raise MeshMismatchError(
            f"the recipe's torus3d layout (mesh {base.name!r}) is laid over one TPU slice of "
            f"three dimensions (v4, v5p), not {topology.name}: give a mesh of "
            f"{topology.num_chips} devices, or another layout"
        )
    return tuple(reversed(topology.shape))


def check_mesh_matches(spec: meshes.MeshSpec, topology: Topology) -> None:
    """Raise :class:`MeshMismatchError` unless ``spec`` has one device per chip."""
    if spec.size != topology.num_chips:
        raise MeshMismatchError(
            f"mesh {spec.name!r} has {spec.size} devices, topology {topology.name} has "
            f"{topology.num_chips} chips: give a mesh of {topology.num_chips} devices, or no "
            "--mesh to lay the recipe's layout over the slice"
        )
