"""Device meshes as data.

A :class:`MeshSpec` names the mesh axes with their sizes, ordered from the least to the most
communication-intensive (outer to inner), says which layout it stands for (``ring``,
``torus2d``, ``torus3d``, ``hierarchical`` or ``pipeline``) and, optionally, how many devices share a host. Specs live as
TOML files in ``meshes/`` and load by preset name or by path::

    spec = jaxdist.meshes.load("torus-4x2")
    mesh = jaxdist.meshes.build(spec)          # a jax.sharding.Mesh
    spec = jaxdist.meshes.load("data=2,fsdp=2,tensor=2")   # inline: axis=size, outer first

An axis's name is its role (:data:`ROLES`): ``data`` splits the batch, ``fsdp`` the state
too (the other data axes then hold replicas of it: HSDP), ``tensor`` the weights
(tensor parallelism), ``stage`` the model into pipeline stages; any other name (``x``,
``host``, ...) is a data axis. ``context`` and ``expert`` are roles no step handles yet, and
are refused (:func:`check_roles`) rather than silently splitting the batch.

The builders :func:`ring`, :func:`torus2d`, :func:`torus3d` and :func:`hierarchical` make the same meshes from
code. Turning a spec into an ordered grid of devices happens in one place, :func:`build`:

* on TPU, ``jax.experimental.mesh_utils`` picks a physical-topology-aware order, and on
  slices without wraparound links each axis is then folded so that its rings take short
  hops (:mod:`jaxdist.ring_order`);
* on GPU and CPU, devices are sorted by (process, id) and laid out row-major, so each host's
  devices sit next to each other along the inner (fast) axis and ring neighbours are adjacent.
"""

from __future__ import annotations

import math
import os
import tomllib
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxdist.checks import is_integer
from jaxdist.ring_order import short_hop_grid

__all__ = [
    "ROLES",
    "STAGE_AXIS",
    "MeshDoesNotFitError",
    "MeshSpec",
    "MeshSpecError",
    "build",
    "check_roles",
    "describe",
    "for_run",
    "hierarchical",
    "load",
    "pipeline",
    "presets",
    "ring",
    "role_of",
    "summary",
    "torus2d",
    "torus3d",
]

LAYOUTS = ("ring", "torus2d", "torus3d", "hierarchical", "pipeline")
_AXES_PER_LAYOUT = {
    "ring": (1,),
    "torus2d": (2,),
    "torus3d": (3,),
    "hierarchical": (2,),
    "pipeline": (2, 3),
}
# The axis a pipeline mesh cuts the model along; its other axes are data axes.
STAGE_AXIS = "stage"
# Axis names that are roles; an axis of any other name is a data axis.
ROLES = ("data", "fsdp", "tensor", "stage", "context", "expert")
HANDLED_ROLES = ("data", "fsdp", "tensor", "stage")
# The layout of an inline spec, by its axis count (a stage axis makes it a pipeline).
_INLINE_LAYOUTS = {1: "ring", 2: "torus2d", 3: "torus3d"}
CPU_DEVICES_HINT = (
    "For a dry run on CPU, force host devices before JAX starts: "
    "`jaxdist --cpu-devices N ...` or XLA_FLAGS=--xla_force_host_platform_device_count=N"
)


class MeshSpecError(ValueError):
    """A mesh spec is malformed."""

    exit_code = 2  # the command line's usage error


class MeshDoesNotFitError(ValueError):
    """A mesh spec needs more devices than are present."""

    exit_code = 2


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh described as data.

    Attributes:
      name: preset or user-chosen name.
      layout: ``ring`` (one axis), ``torus2d`` (two axes), ``torus3d`` (three axes, as the
        chips of a TPU v4 or v5p slice are wired), ``hierarchical`` (two axes:
        hosts, then devices inside a host) or ``pipeline`` (one or two data axes and the
        axis named ``stage`` the model is cut along).
      axes: ``((axis_name, size), ...)`` ordered outer (least communication) to inner (most).
      devices_per_host: devices that share fast links; ``None`` if unknown or irrelevant.
      description: free text: what hardware this stands for.
    """

    name: str
    layout: str
    axes: tuple[tuple[str, int], ...]
    devices_per_host: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple((n, s) for n, s in self.axes))
        self.validate()  # before any conversion, so that a size written "2" is refused
        object.__setattr__(self, "axes", tuple((n, int(s)) for n, s in self.axes))

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def num_hosts(self) -> int | None:
        return None if self.devices_per_host is None else self.size // self.devices_per_host

    def validate(self) -> None:
        """Raise :class:`MeshSpecError` naming what was expected and what was found."""
        where = f"mesh spec {self.name!r}"
        if self.layout not in LAYOUTS:
            raise MeshSpecError(f"{where}: layout must be one of {LAYOUTS}, got {self.layout!r}")
        want = _AXES_PER_LAYOUT[self.layout]
        if len(self.axes) not in want:
            raise MeshSpecError(
                f"{where}: layout {self.layout!r} needs {' or '.join(map(str, want))} axes, got "
                f"{len(self.axes)}: {list(self.axis_names)}"
            )
        names = self.axis_names
        if self.layout == "pipeline" and STAGE_AXIS not in names:
            raise MeshSpecError(
                f"{where}: a pipeline mesh needs an axis named {STAGE_AXIS!r}, got {list(names)}"
            )
        if len(set(names)) != len(names):
            raise MeshSpecError(f"{where}: axis names must be distinct, got {list(names)}")
        for name, size in self.axes:
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshSpecError(f"{where}: axis name must be an identifier, got {name!r}")
            if not is_integer(size) or size < 1:
                raise MeshSpecError(
                    f"{where}: axis {name!r} must have an integer size >= 1, got {size!r}"
                )
        dph = self.devices_per_host
        if dph is not None:
            if not is_integer(dph):
                raise MeshSpecError(f"{where}: devices_per_host must be an integer, got {dph!r}")
            if dph < 1 or self.size % dph:
                raise MeshSpecError(
                    f"{where}: devices_per_host must be >= 1 and divide the mesh size "
                    f"{self.size}, got {dph}"
                )
            inner = self.shape[-1]
            if inner % dph and dph % inner:
                raise MeshSpecError(
                    f"{where}: devices_per_host={dph} must divide, or be a multiple of, the "
                    f"inner axis {names[-1]!r} of size {inner}, so each host's devices stay "
                    f"together along the fast axis"
                )
        if self.layout == "hierarchical" and dph is not None and dph != self.shape[-1]:
            raise MeshSpecError(
                f"{where}: a hierarchical mesh's inner axis {names[-1]!r} is the devices of one "
                f"host, so its size ({self.shape[-1]}) must equal devices_per_host ({dph})"
            )


# --------------------------------------------------------------------------- presets / files


def presets_dir() -> Path:
    """Folder holding the preset TOML files (``$JAXDIST_MESHES`` overrides it)."""
    override = os.environ.get("JAXDIST_MESHES")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "meshes"


def presets() -> list[str]:
    """Names of the available presets."""
    folder = presets_dir()
    return sorted(p.stem for p in folder.glob("*.toml")) if folder.is_dir() else []


def from_dict(data: dict, *, default_name: str = "") -> MeshSpec:
    """Build a spec from parsed TOML: ``name``, ``layout``, ``axes``, ``devices_per_host``."""
    where = f"mesh spec {data.get('name', default_name)!r}"
    allowed = {"name", "layout", "axes", "devices_per_host", "description"}
    unknown = set(data) - allowed
    if unknown:
        raise MeshSpecError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(allowed)}")
    for key in ("layout", "axes"):
        if key not in data:
            raise MeshSpecError(f"{where}: missing required key {key!r}")
    axes = []
    for entry in data["axes"]:
        if not isinstance(entry, dict) or set(entry) != {"name", "size"}:
            raise MeshSpecError(
                f"{where}: each axis must be a table {{name = ..., size = ...}}, got {entry!r}"
            )
        axes.append((entry["name"], entry["size"]))
    return MeshSpec(
        name=data.get("name", default_name),
        layout=data["layout"],
        axes=tuple(axes),
        devices_per_host=data.get("devices_per_host"),
        description=data.get("description", ""),
    )


def role_of(axis_name: str) -> str:
    """The role of a mesh axis: its name if that is one of :data:`ROLES`, else ``data``."""
    return axis_name if axis_name in ROLES else "data"


def check_roles(axis_names: Sequence[str]) -> None:
    """One line for an axis whose role no step handles yet."""
    for name in axis_names:
        if role_of(name) not in HANDLED_ROLES:
            raise MeshSpecError(
                f"mesh axis {name!r} has the role {name}, which no step "
                f"handles yet (handled: {', '.join(HANDLED_ROLES)})"
            )


def parse_inline(text: str) -> MeshSpec:
    """``"data=2,fsdp=2,tensor=2"`` as a spec: axes outer to inner, each ``name=size``; the
    layout by the axis count (ring, torus2d, torus3d; pipeline with a ``stage`` axis)."""
    axes = []
    for entry in text.split(","):
        name, _, size = (part.strip() for part in entry.partition("="))
        if not size.isdigit():
            raise MeshSpecError(
                f"an inline mesh is axis=size pairs, comma-separated "
                f"(data=2,tensor=4); got {entry.strip()!r} in {text!r}"
            )
        axes.append((name, int(size)))
    names = [name for name, _ in axes]
    layout = "pipeline" if STAGE_AXIS in names else _INLINE_LAYOUTS.get(len(axes))
    if layout is None:
        raise MeshSpecError(
            f"an inline mesh has 1 to 3 axes (a TOML spec can say more); got "
            f"{len(axes)} in {text!r}"
        )
    return MeshSpec(name=text, layout=layout, axes=tuple(axes))


def load(name_or_path: str | os.PathLike) -> MeshSpec:
    """Load a spec by preset name (``"torus-4x2"``), from a TOML file path, or inline
    (``"data=2,tensor=4"``, :func:`parse_inline`)."""
    if "=" in str(name_or_path) and not str(name_or_path).endswith(".toml"):
        return parse_inline(str(name_or_path))
    path = Path(name_or_path)
    if path.suffix != ".toml" and not path.exists():
        path = presets_dir() / f"{name_or_path}.toml"
        if not path.exists():
            raise MeshSpecError(
                f"no mesh preset named {str(name_or_path)!r} in {presets_dir()}; "
                f"available: {', '.join(presets()) or '(none)'}; or pass a path to a .toml file"
            )
    if not path.is_file():
        raise MeshSpecError(f"mesh spec file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise MeshSpecError(f"mesh spec file {str(path)!r} is not valid TOML: {err}") from err
    return from_dict(data, default_name=path.stem)


# --------------------------------------------------------------------------- building meshes


def _ordered_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    devices = list(jax.devices() if devices is None else devices)
    # Keep every process's (host's) devices contiguous, then order by id inside a host.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def check_fits(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> int:
    """Return the number of devices present; raise :class:`MeshDoesNotFitError` if too few."""
    present = len(jax.devices() if devices is None else devices)
    if spec.size > present:
        raise MeshDoesNotFitError(
            f"mesh {spec.name!r} ({' x '.join(map(str, spec.shape))} = {spec.size} devices) "
            f"does not fit: {present} device(s) present. {CPU_DEVICES_HINT} with N={spec.size}."
        )
    return present


def device_grid(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> np.ndarray:
    """The devices of ``spec`` as an array of its shape, in communication-friendly order."""
    check_fits(spec, devices)
    ordered = _ordered_devices(devices)
    if ordered[0].platform == "tpu" and len(ordered) == spec.size:
        if jax.process_count() > 1 and spec.num_hosts and spec.num_hosts > 1:
            outer = spec.shape[0]
            if outer % jax.process_count():
                raise MeshDoesNotFitError(
                    f"mesh {spec.name!r}: on TPU each process must hold whole rows, so the "
                    f"outer axis {spec.axis_names[0]!r} ({outer}) must be a multiple of the "
                    f"process count ({jax.process_count()})"
                )
            dcn = (jax.process_count(),) + (1,) * (len(spec.shape) - 1)
            ici = (outer // jax.process_count(), *spec.shape[1:])
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=ordered)
        else:
            grid = _tpu_device_mesh(spec, ordered)
        return short_hop_grid(grid)
    # A sub-mesh (fewer devices than present) takes the first devices in (process, id) order.
    return np.array(ordered[: spec.size], dtype=object).reshape(spec.shape)


def _tpu_device_mesh(spec: MeshSpec, devices: list[jax.Device]) -> np.ndarray:
    """The TPU devices laid out so that each mesh axis follows the physical torus; an axis
    whose size is no product of the torus dimensions (48 x 72 on 12x12x24) splits them."""
    try:
        return mesh_utils.create_device_mesh(spec.shape, devices=devices)
    except NotImplementedError:
        pass
    try:
        return mesh_utils.create_device_mesh(
            spec.shape, devices=devices, allow_split_physical_axes=True
        )
    except NotImplementedError as err:
        raise MeshDoesNotFitError(
            f"mesh {spec.name!r} ({' x '.join(map(str, spec.shape))}) cannot be laid over the "
            f"TPU torus of its {len(devices)} chips: {str(err).splitlines()[0]}"
        ) from err


def host_mismatch(spec: MeshSpec, grid: np.ndarray) -> str | None:
    """Why the real hosts (processes) of ``grid`` do not match ``spec.devices_per_host``, or
    None (also when one process holds every device: its hosts are then emulated)."""
    if spec.devices_per_host is None:
        return None
    per_process = Counter(d.process_index for d in grid.reshape(-1))
    found = sorted(set(per_process.values()))
    if len(per_process) < 2 or found == [spec.devices_per_host]:
        return None
    hint = ""
    if len(found) == 1:
        hint = (
            f"; for hosts of {found[0]}, use a spec with devices_per_host = {found[0]} (in "
            f"code: jaxdist.meshes.hierarchical({len(per_process)}, {found[0]}))"
        )
    head = (
        f"mesh {spec.name!r} expects {spec.devices_per_host} devices per host, but its devices "
        f"come from {len(per_process)} processes with {'/'.join(map(str, found))} each"
    )
    if all(k % spec.devices_per_host == 0 for k in found):
        return (
            f"{head}: each process holds several of its rows, so steps along "
            f"{spec.axis_names[0]!r} meant to cross hosts partly stay inside one{hint}"
        )
    return (
        f"{head}, so its rows along {spec.axis_names[-1]!r} are not the real hosts and "
        f"traffic meant to stay inside a host crosses between hosts{hint}"
    )


def build(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Turn a spec (or a preset name / path) into a ``jax.sharding.Mesh``; warns when the
    spec's hosts are not the real ones (see :func:`host_mismatch`)."""
    if not isinstance(spec, MeshSpec):
        spec = load(spec)
    check_fits(spec, devices)
    # The grid holds the first spec.size devices in (process, id) order, whatever their
    # arrangement, and the hosts' device counts do not depend on the arrangement.
    used = np.array(_ordered_devices(devices)[: spec.size], dtype=object)
    mismatch = host_mismatch(spec, used)
    if mismatch:
        warnings.warn(mismatch, stacklevel=2)
    return Mesh(device_grid(spec, devices), spec.axis_names)


def for_run(name: str, stages: int = 0) -> Mesh:
    """A run's mesh: the preset, TOML path or inline spec ``name``, on every device of every
    process; ``""``: all devices as one ``data`` axis, or with ``stages`` pipeline stages as
    ``data x stage`` (neighbouring stages on neighbouring devices). Refuses an axis whose
    role no step handles (:func:`check_roles`)."""
    count = jax.device_count()
    if name:
        spec = load(name)
        if jax.process_count() > 1 and spec.size != count:
            # A mesh on part of the devices would leave whole processes out of every step.
            raise MeshDoesNotFitError(
                f"mesh {spec.name!r} ({' x '.join(map(str, spec.shape))} = {spec.size} devices) "
                f"does not match this run: {jax.process_count()} processes with "
                f"{jax.local_device_count()} devices each = {count}. Start processes x devices "
                f"= {spec.size} (srun --ntasks, mpirun -np, jaxdist launch --processes; "
                f"--cpu-devices on CPU), or give a mesh of {count} devices (--set mesh=...)"
            )
    elif not stages:
        spec = MeshSpec(f"ring-{count}", "ring", (("data", count),))
    elif count % stages:
        raise ValueError(
            f"pipeline.stages={stages} does not divide the {count} devices; give "
            "a stage count that does, or a mesh (--set mesh=...)"
        )
    else:
        spec = _pipeline_spec(count // stages, stages)
    check_roles(spec.axis_names)
    return build(spec)


def ring(n: int, axis_name: str = "x", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ring of ``n`` devices; ring neighbours are adjacent devices."""
    return build(MeshSpec(f"ring-{n}", "ring", ((axis_name, n),)), devices)


def torus2d(
    rows: int,
    cols: int,
    axis_names: tuple[str, str] = ("y", "x"),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``rows x cols`` 2-D torus; each row (the inner axis) holds consecutive devices."""
    return build(
        MeshSpec(f"torus-{rows}x{cols}", "torus2d", tuple(zip(axis_names, (rows, cols)))), devices
    )


def torus3d(
    planes: int,
    rows: int,
    cols: int,
    axis_names: tuple[str, str, str] = ("z", "y", "x"),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``planes x rows x cols`` 3-D torus; each row (the inner axis) holds consecutive
    devices."""
    shape = (planes, rows, cols)
    name = "torus-" + "x".join(map(str, shape))
    return build(MeshSpec(name, "torus3d", tuple(zip(axis_names, shape))), devices)


def hierarchical(
    hosts: int,
    devices_per_host: int,
    axis_names: tuple[str, str] = ("host", "local"),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """``hosts`` hosts of ``devices_per_host`` devices; the inner axis stays inside a host."""
    spec = MeshSpec(
        f"hierarchical-{hosts}x{devices_per_host}",
        "hierarchical",
        tuple(zip(axis_names, (hosts, devices_per_host))),
        devices_per_host=devices_per_host,
    )
    return build(spec, devices)


def pipeline(replicas: int, stages: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """``replicas`` data-parallel copies (outer axis ``data``) of a ``stages``-stage pipeline
    (inner axis ``stage``): neighbouring stages are neighbouring devices."""
    return build(_pipeline_spec(replicas, stages), devices)


def _pipeline_spec(replicas: int, stages: int) -> MeshSpec:
    return MeshSpec(
        f"pipeline-{replicas}x{stages}", "pipeline", (("data", replicas), (STAGE_AXIS, stages))
    )


def host_of(spec: MeshSpec, grid: np.ndarray) -> np.ndarray:
    """Host number of every grid position: the real process when several run, else emulated
    from ``devices_per_host`` (consecutive devices form a host)."""
    flat = grid.reshape(-1)
    if len({d.process_index for d in flat}) > 1 or spec.devices_per_host is None:
        return np.array([d.process_index for d in flat]).reshape(grid.shape)
    return (np.arange(flat.size) // spec.devices_per_host).reshape(grid.shape)


def summary(spec: MeshSpec) -> str:
    """One line (plus the description) saying what the spec is, without touching devices."""
    per_host = spec.devices_per_host
    hosts = f", {spec.num_hosts} host(s) of {per_host}" if per_host else ""
    axes = " x ".join(f"{n}={s}" for n, s in spec.axes)
    text = f"mesh {spec.name}: layout={spec.layout} {axes} ({spec.size} devices{hosts})"
    return text + (f"\n  {spec.description}" if spec.description else "")


def describe(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> str:
    """Human-readable layout: the grid of device ids and hosts, validated against ``devices``."""
    lines = [summary(spec)]
    grid = device_grid(spec, devices)
    hosts = host_of(spec, grid)
    present = len(jax.devices() if devices is None else devices)
    lines.append(f"  fits: uses {spec.size} of {present} {grid.reshape(-1)[0].platform} device(s)")
    rows = grid.reshape(-1, spec.shape[-1])
    host_rows = hosts.reshape(-1, spec.shape[-1])
    outer = spec.axes[:-1]
    lines.append(f"  device id [host] along inner axis {spec.axis_names[-1]!r}:")
    for r, (devs, hs) in enumerate(zip(rows, host_rows)):
        index = np.unravel_index(r, [size for _, size in outer]) if outer else ()
        label = ",".join(f"{name}={i}" for (name, _), i in zip(outer, index))
        label = label + " " * (3 - len(str(index[-1]))) if outer else "ring  "
        cells = " ".join(f"{d.id:>3d}[{h}]" for d, h in zip(devs, hs))
        lines.append(f"    {label} {cells}")
    mismatch = host_mismatch(spec, grid)
    if mismatch:
        lines.append(f"  warning: {mismatch}")
    return "\n".join(lines)
