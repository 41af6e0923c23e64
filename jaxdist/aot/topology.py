"""Slices and clusters described by name, with compile-only devices from the compiler.

``"v5e:16x16"`` names a TPU generation and a slice shape in chips, as Cloud TPU writes it.
The TPU compiler, installed with ``pip install 'jaxdist[tpu]'``, turns the name into device
descriptions that ``jax.jit(...).lower(...).compile()`` can target on a machine without any
TPU: the program is compiled exactly as on the slice, and nothing runs. Several slices
joined by the data-centre network are written ``v5e:16x16/2`` (two slices).

``"h100:4x8"`` names GPU hosts: 4 hosts of 8 H100s. The XLA GPU compiler of the CUDA plugin
(``pip install 'jax[cuda12-local]'``, the ``gpu-plan`` extra) compiles for them from a target description of the GPU
(``targets/h100.txtpb`` beside this module) with no GPU and no CUDA driver present. Kernels
are not autotuned without a GPU, so memory and the collectives are as on the GPU; kernel
choices may differ.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxdist.aot.chips import CHIPS, Chip

__all__ = [
    "CompilerMissing",
    "Topology",
    "TopologyError",
    "parse_topology",
]

# Generations the installed TPU compiler can target, one device per chip (v4 and v5p fuse
# their two TensorCores into one device, "megacore", as training on them does).
GENERATIONS = {"v4": "megacore", "v5e": None, "v5p": None, "v6e": None}
# GPUs with a target description in targets/ (compiled by the CUDA plugin).
GPU_TARGETS = {"h100": Path(__file__).with_name("targets") / "h100.txtpb"}
_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
# How Cloud TPU names a slice of n chips; only quiets libtpu's start-up warning.
_ACCELERATOR_TYPE = {
    "v4": lambda n: f"v4-{2 * n}",
    "v5e": lambda n: f"v5litepod-{n}",
    "v5p": lambda n: f"v5p-{2 * n}",
    "v6e": lambda n: f"v6e-{n}",
}
LIBTPU_HINT = "install the TPU compiler with: pip install 'jaxdist[tpu]'"
CUDA_HINT = "install the GPU compiler with: pip install 'jax[cuda12-local]' (the gpu-plan extra)"
_NAME = re.compile(r"^(v\d+[a-z]?):(\d+(?:x\d+){1,2})(?:/(\d+))?$")
_GPU_NAME = re.compile(r"^([a-z]\d+):(\d+)x(\d+)$")


class TopologyError(ValueError):
    """A topology name that cannot be compiled for."""

    exit_code = 2


class CompilerMissing(RuntimeError):
    """The compiler for the topology (libtpu, or the CUDA plugin) is not installed."""

    exit_code = 2


def libtpu_available() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package) is installed; nothing is loaded."""
    return importlib.util.find_spec("libtpu") is not None


def cuda_plugin_available() -> bool:
    """Whether JAX's CUDA plugin (the GPU compiler) is installed; nothing is loaded."""
    return any(_module_exists(name) for name in _CUDA_PLUGINS)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the jax_plugins namespace itself is absent
        return False


@dataclass(frozen=True)
class Topology:
    """A TPU slice (or several, joined by the data-centre network), or GPU hosts, to
    compile for.

    Attributes:
      name: as given, e.g. ``"v5e:16x16"``, ``"v5p:8x8x16/2"`` or ``"h100:4x8"``.
      generation: ``"v5e"``, ``"h100"``, ...; its figures are ``chip``.
      shape: a TPU slice: chips along each ICI axis; GPUs: (hosts, GPUs per host).
      slices: TPU slices joined by DCN (1 for GPUs).
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
    def is_gpu(self) -> bool:
        return self.generation in GPU_TARGETS

    @property
    def num_hosts(self) -> int:
        if self.is_gpu:
            return self.shape[0]
        return self.slices * math.ceil(self.chips_per_slice / self.chip.chips_per_host)

    @property
    def network_groups(self) -> int:
        """Groups of chips joined only by the host network: TPU slices, or GPU hosts."""
        return self.shape[0] if self.is_gpu else self.slices

    @property
    def chips_per_group(self) -> int:
        return self.num_chips // self.network_groups

    def devices(self) -> list[jax.Device]:
        """Compile-only devices of every chip, from the target's compiler (no chip needed)."""
        devices = self._gpu_devices() if self.is_gpu else self._tpu_devices()
        if len(devices) != self.num_chips:
            raise TopologyError(
                f"topology {self.name!r}: expected one device per chip ({self.num_chips}), "
                f"the compiler gave {len(devices)}"
            )
        return devices

    def _gpu_devices(self) -> list[jax.Device]:
        if not cuda_plugin_available():
            raise CompilerMissing(f"compiling for {self.name} needs the GPU compiler; {CUDA_HINT}")
        from jax.experimental import topologies

        hosts, per_host = self.shape
        try:  # "<partitions>x<hosts per partition>x<devices per host>"
            described = topologies.get_topology_desc(
                platform="cuda",
                target_config=GPU_TARGETS[self.generation].read_text(),
                topology=f"1x{hosts}x{per_host}",
            )
        except Exception as err:  # the compiler's own error names what it refused
            raise TopologyError(
                f"the GPU compiler refused topology {self.name!r}: {str(err).splitlines()[0]}"
                " (it compiles only where JAX itself runs on the CPU: JAX_PLATFORMS=cpu)"
            ) from err
        return list(described.devices)

    def _tpu_devices(self) -> list[jax.Device]:
        if not libtpu_available():
            raise CompilerMissing(
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
        return list(described.devices)


def parse_topology(name: str) -> Topology:
    """``"v5e:16x16"`` (``"v5p:8x8x16/2"`` for two slices), or ``"h100:4x8"`` (4 hosts of 8
    GPUs), as a :class:`Topology`."""
    gpu = _GPU_NAME.match(name.strip())
    if gpu and gpu.group(1) in GPU_TARGETS:
        hosts, per_host = int(gpu.group(2)), int(gpu.group(3))
        if min(hosts, per_host) < 1:
            raise TopologyError(f"topology {name!r}: sizes must be >= 1")
        return Topology(name.strip(), gpu.group(1), (hosts, per_host))
    match = _NAME.match(name.strip())
    if not match:
        raise TopologyError(
            f"topology must look like GENERATION:SHAPE[/SLICES] for a TPU slice (v5e:16x16, "
            f"v5p:8x8x16, v5e:16x16/2) or GPU:HOSTSxGPUS for GPU hosts (h100:4x8); got {name!r}"
        )
    generation, shape_text, slices = match.groups()
    if generation not in GENERATIONS:
        raise TopologyError(
            f"topology {name!r}: TPU generation must be one of {sorted(GENERATIONS)} (GPUs: "
            f"{sorted(GPU_TARGETS)}), got {generation!r}"
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
