"""The accelerators a plan can be made for: peak compute, memory and links, with sources.

Every figure is the vendor's published one; ``source`` names the page (docs/planning.md
lists them with the derivations). TPU v4, v5e, v5p and v6e are the targets the TPU compiler
compiles for (:mod:`jaxdist.aot.topology`); TPU v3 and the GPUs are here so that published
runs on them can be set against the time model (:mod:`jaxdist.aot.published`).

Links feed the alpha-beta cost model (:mod:`jaxdist.comm.cost_model`):

* the fast link is one direction of one ICI link on a TPU (a ring step on a torus drives
  two, one to each neighbour, so ``link_ports`` is 2), and one direction of all of a GPU's
  NVLinks together behind its switch (``link_ports`` 1);
* the host network is bytes/s per chip between hosts, or between slices (DCN, InfiniBand).

The vendors publish bandwidths, not latencies: each link's per-message latency is
:data:`ASSUMED_LINK_LATENCY` unless the caller gives one, and a plan prints the value used.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.comm.cost_model import Link, Network

__all__ = [
    "CHIPS",
    "Chip",
]

GIB = 2**30
GB = 1e9
GBIT = 1e9 / 8
# Seconds per message: ICI and NVLink hops, and a host network (DCN, InfiniBand) message.
ASSUMED_LINK_LATENCY = {"ici": 2e-6, "nvlink": 3e-6, "host": 10e-6}


@dataclass(frozen=True)
class Chip:
    """One accelerator's published figures.

    Attributes:
      name: the vendor's name.
      peak_flops: dense 16-bit (bf16, or fp16 on tensor cores) FLOP/s of one chip.
      peak_flops_fp32: dense float32 FLOP/s, for runs that trained in float32.
      hbm_bytes: memory of one chip, as published, converted to bytes. TPU pages write GB
        for what are GiB (a v5e's "16 GB" is 16 GiB: its compiler's own limit is 15.75 GiB,
        16 GiB less the runtime's reserve); GPU pages mean GB.
      hbm_bandwidth: bytes/s.
      link_bandwidth: bytes/s in one direction of the fast link (see the module docstring).
      link_ports: fast links a chip drives at once in a ring step.
      host_network: bytes/s per chip between hosts or slices (None: not published).
      chips_per_host: chips that share a host.
      torus_dims: dimensions of a TPU slice's torus (0: not a TPU).
      source: where the figures are published.
    """

    name: str
    peak_flops: float
    peak_flops_fp32: float
    hbm_bytes: float
    hbm_bandwidth: float
    link_bandwidth: float
    link_ports: int
    host_network: float | None
    chips_per_host: int
    torus_dims: int
    source: str

    @property
    def link_kind(self) -> str:
        return "ici" if self.torus_dims else "nvlink"


CHIPS: dict[str, Chip] = {
    # ICI per link in one direction: the per-chip bidirectional figure over the ports, halved.
    "v3": Chip(
        name="TPU v3",
        peak_flops=123e12,
        peak_flops_fp32=0.0,
        hbm_bytes=32 * GIB,
        hbm_bandwidth=900 * GB,
        link_bandwidth=100 * GB,  # scaling book: 1e11 B/s one way per link
        link_ports=2,
        host_network=None,
        chips_per_host=4,
        torus_dims=2,
        source="https://cloud.google.com/tpu/docs/v3; https://jax-ml.github.io/scaling-book/tpus",
    ),
    "v4": Chip(
        name="TPU v4",
        peak_flops=275e12,
        peak_flops_fp32=0.0,
        hbm_bytes=32 * GIB,
        hbm_bandwidth=1200 * GB,
        link_bandwidth=45 * GB,  # scaling book: 4.5e10 B/s one way per link, 6 links
        link_ports=2,
        host_network=25 * GB / 4,  # scaling book: about 2.5e10 B/s of DCN per 4-chip host
        chips_per_host=4,
        torus_dims=3,
        source="https://cloud.google.com/tpu/docs/v4; https://jax-ml.github.io/scaling-book/tpus",
    ),
    "v5e": Chip(
        name="TPU v5e",
        peak_flops=197e12,
        peak_flops_fp32=0.0,
        hbm_bytes=16 * GIB,
        hbm_bandwidth=819 * GB,
        link_bandwidth=400 * GB / 4 / 2,  # 400 GB/s bidirectional per chip over 4 ports
        link_ports=2,
        host_network=2 * 100 * GBIT / 8,  # 2 x 100 Gbps NICs per host of 8 chips
        chips_per_host=8,
        torus_dims=2,
        source="https://cloud.google.com/tpu/docs/v5e",
    ),
    "v5p": Chip(
        name="TPU v5p",
        peak_flops=459e12,
        peak_flops_fp32=0.0,
        hbm_bytes=95 * GIB,
        hbm_bandwidth=2765 * GB,
        link_bandwidth=1200 * GB / 6 / 2,  # 1200 GB/s bidirectional per chip over 6 links
        link_ports=2,
        host_network=50 * GBIT,  # 50 Gbps of DCN per chip
        chips_per_host=4,
        torus_dims=3,
        source="https://cloud.google.com/tpu/docs/v5p",
    ),
    "v6e": Chip(
        name="TPU v6e (Trillium)",
        peak_flops=918e12,
        peak_flops_fp32=0.0,
        hbm_bytes=32 * GIB,
        hbm_bandwidth=1640 * GB,
        link_bandwidth=800 * GB / 4 / 2,  # 800 GB/s bidirectional per chip over 4 ports
        link_ports=2,
        host_network=4 * 200 * GBIT / 8,  # 4 x 200 Gbps NICs per host of 8 chips
        chips_per_host=8,
        torus_dims=2,
        source="https://cloud.google.com/tpu/docs/v6e",
    ),
    # NVLink: the GPU's total bidirectional figure, halved. Host network: a DGX-class node,
    # one InfiniBand port per GPU (a published run gives its own cluster's figure).
    "p100": Chip(
        name="NVIDIA P100 SXM2",
        peak_flops=21.2e12,
        peak_flops_fp32=10.6e12,
        hbm_bytes=16 * GB,
        hbm_bandwidth=732 * GB,
        link_bandwidth=160 * GB / 2,
        link_ports=1,
        host_network=50 * GBIT,  # DGX-1: 4 x 100 Gb/s EDR per 8 GPUs
        chips_per_host=8,
        torus_dims=0,
        source="https://www.nvidia.com/en-us/data-center/tesla-p100/",
    ),
    "v100": Chip(
        name="NVIDIA V100 SXM2",
        peak_flops=125e12,
        peak_flops_fp32=15.7e12,
        hbm_bytes=16 * GB,
        hbm_bandwidth=900 * GB,
        link_bandwidth=300 * GB / 2,
        link_ports=1,
        host_network=50 * GBIT,  # DGX-1 (4 x EDR per 8 GPUs), ABCI (2 x EDR per 4 GPUs)
        chips_per_host=8,
        torus_dims=0,
        source="https://www.nvidia.com/en-us/data-center/v100/",
    ),
    "a100": Chip(
        name="NVIDIA A100 SXM4",
        peak_flops=312e12,
        peak_flops_fp32=19.5e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=2039 * GB,
        link_bandwidth=600 * GB / 2,
        link_ports=1,
        host_network=200 * GBIT,  # DGX A100: 8 x 200 Gb/s HDR per node
        chips_per_host=8,
        torus_dims=0,
        source="https://www.nvidia.com/en-us/data-center/a100/",
    ),
    "h100": Chip(
        name="NVIDIA H100 SXM5",
        peak_flops=989e12,
        peak_flops_fp32=67e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=3350 * GB,
        link_bandwidth=900 * GB / 2,
        link_ports=1,
        host_network=400 * GBIT,  # DGX H100: 8 x 400 Gb/s NDR per node
        chips_per_host=8,
        torus_dims=0,
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    "h200": Chip(
        name="NVIDIA H200 SXM",
        peak_flops=989e12,
        peak_flops_fp32=67e12,
        hbm_bytes=141 * GB,
        hbm_bandwidth=4800 * GB,
        link_bandwidth=900 * GB / 2,
        link_ports=1,
        host_network=400 * GBIT,  # DGX H200: 8 x 400 Gb/s NDR per node
        chips_per_host=8,
        torus_dims=0,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
}


def network_for(
    chip: Chip, *, host_network: float | None = None, latency: dict[str, float] | None = None
) -> Network:
    """The cost model's links for ``chip``: the fast links for the inner axis and, with
    ``host_network`` bytes/s per chip, a host network for the outer axis (None: the fast
    links everywhere, as inside one TPU slice)."""
    latency = {**ASSUMED_LINK_LATENCY, **(latency or {})}
    fast = Link(latency[chip.link_kind], 1.0 / chip.link_bandwidth, chip.link_ports)
    if host_network is None:
        return Network(fast)
    return Network(fast, Link(latency["host"], 1.0 / host_network, 1))
