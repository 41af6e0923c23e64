"""TPU slices described by name, with compile-only devices from the TPU compiler (libtpu).

``"v5e:16x16"`` names a generation and a slice shape in chips, as Cloud TPU writes it. The
TPU compiler, installed with ``pip install 'jaxdist[tpu]'``, turns the name into device
descriptions that ``jax.jit(...).lower(...).compile()`` can target on a machine without any
TPU: the program is compiled exactly as on the slice, and nothing runs. A slice made of
several slices joined by the data-centre network is written ``v5e:16x16/2`` (two slices).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass

import jax

from jaxdist.aot.chips import CHIPS, Chip

__all__ = [
    "GENERATIONS",
    "LIBTPU_HINT",
    "Topology",
    "TopologyError",
    "TpuCompilerMissing",
    "libtpu_available",
    "parse_topology",
]

# Generations the installed TPU compiler can target, one device per chip (v4 and v5p fuse
# their two TensorCores into one device, "megacore", as training on them does).
GENERATIONS = {"v4": "megacore", "v5e": None, "v5p": None, "v6e": None}
# How Cloud TPU names a slice of n chips; only quiets libtpu's start-up warning.
_ACCELERATOR_TYPE = {
    "v4": lambda n: f"v4-{2 * n}",
    "v5e": lambda n: f"v5litepod-{n}",
    "v5p": lambda n: f"v5p-{2 * n}",
    "v6e": lambda n: f"v6e-{n}",
}
LIBTPU_HINT = "install the TPU compiler with: pip install 'jaxdist[tpu]'"
_NAME = re.compile(r"^(v\d+[a-z]?):(\d+(?:x\d+){1,2})(?:/(\d+))?$")


class TopologyError(ValueError):
    """A topology name that cannot be compiled for."""

    exit_code = 2


class TpuCompilerMissing(RuntimeError):
    """libtpu is not installed, so nothing can be compiled for a TPU."""

    exit_code = 2


def libtpu_available() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package) is installed; nothing is loaded."""
    return importlib.util.find_spec("libtpu") is not None


@dataclass(frozen=True)
class Topology:
    """A TPU slice (or several, joined by the data-centre network) to compile for.

    Attributes:
      name: as given, e.g. ``"v5e:16x16"`` or ``"v5p:8x8x16/2"``.
      generation: ``"v5e"``, ...; its figures are ``chip``.
      shape: chips along each ICI axis of one slice.
      slices: slices joined by DCN.
    """

    name: str
    generation: str
    shape: tuple[int, ...]
    slices: int = 1

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.shape)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.slices

    @property
    def num_hosts(self) -> int:
        return math.ceil(self.num_chips / self.chip.chips_per_host)

    def devices(self) -> list[jax.Device]:
        """Compile-only devices of every chip, from the TPU compiler (no TPU needed)."""
        if not libtpu_available():
            raise TpuCompilerMissing(
                f"compiling for {self.name} needs the TPU compiler; {LIBTPU_HINT}"
            )
        _quiet_libtpu(self)
        from jax.experimental import topologies

        options = {}
        if GENERATIONS[self.generation]:
            options["chip_config_name"] = GENERATIONS[self.generation]
        if self.slices > 1:
            options["num_slices"] = self.slices
        shape = "x".join(map(str, self.shape))
        try:
            described = topologies.get_topology_desc(
                topology_name=f"{self.generation}:{shape}", platform="tpu", **options
            )
        except Exception as err:  # the compiler's own error names what it refused
            raise TopologyError(
                f"the TPU compiler refused topology {self.name!r}: {str(err).splitlines()[0]}"
            ) from err
        devices = list(described.devices)
        if len(devices) != self.num_chips:
            raise TopologyError(
                f"topology {self.name!r}: expected one device per chip ({self.num_chips}), "
                f"the TPU compiler gave {len(devices)}"
            )
        return devices


def parse_topology(name: str) -> Topology:
    """``"v5e:16x16"`` (or ``"v5p:8x8x16/2"`` for two slices) as a :class:`Topology`."""
    match = _NAME.match(name.strip())
    if not match:
        raise TopologyError(
            f"topology must look like GENERATION:SHAPE[/SLICES], e.g. v5e:16x16, v5p:8x8x16 or "
            f"v5e:16x16/2; got {name!r}"
        )
    generation, shape_text, slices = match.groups()
    if generation not in GENERATIONS:
        raise TopologyError(
            f"topology {name!r}: TPU generation must be one of {sorted(GENERATIONS)}, "
            f"got {generation!r}"
        )
    shape = tuple(int(n) for n in shape_text.split("x"))
    want = CHIPS[generation].torus_dims
    if len(shape) != want:
        example = "x".join(["4"] * want)
        raise TopologyError(
            f"topology {name!r}: a {generation} slice has {want} dimensions "
            f"(e.g. {generation}:{example}), got {len(shape)}"
        )
    if min(shape) < 1 or (slices is not None and int(slices) < 1):
        raise TopologyError(f"topology {name!r}: sizes must be >= 1")
    return Topology(name.strip(), generation, shape, int(slices or 1))


def _quiet_libtpu(topology: Topology) -> None:
    """Tell libtpu what it would otherwise ask a Cloud TPU VM's metadata server: no server
    to wait on and no warnings printed. Set before libtpu loads; a value already set wins.

    libtpu also takes a lock file that lets one process at a time drive the chips; compiling
    drives none, so several plans (or a plan beside a run on the chips) may load it at once.
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault(
        "TPU_ACCELERATOR_TYPE",
        _ACCELERATOR_TYPE[topology.generation](topology.chips_per_slice),
    )
