"""A layer profile for a chip that is not here, from its compiler (:mod:`jaxdist.aot.topology`).

Each layer's forward and backward pass (:func:`jaxdist.pipeline.profile.profile_layers`) is
compiled for one chip of the topology; the compiler counts its FLOPs and the bytes it moves
through memory, and the layer's time is the roofline of the two on the chip's published peak:
``max(flops / peak, bytes / memory bandwidth)``. That is a lower bound on a real step, but
the partitioner only compares layers with each other, so it cuts a pod's stages by the costs
its own chip sees: a convolution and a memory-bound BatchNorm weigh differently on a TPU and
on this machine's CPU. Nothing runs; the arguments are shapes on the target device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxdist.aot.compile import _cost_analysis, no_cache_write_unless_here
from jaxdist.aot.topology import Topology
from jaxdist.pipeline.profile import Profile, profile_layers

__all__ = ["compiler_profile"]


def compiler_profile(
    model: nn.Module,
    example: jax.ShapeDtypeStruct,
    optimizer: Any,
    topology: Topology,
    *,
    description: dict[str, Any],
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """The profile of ``model`` on one micro-batch shaped like ``example``, priced for
    ``topology``'s chip by its compiler."""
    device = topology.devices()[0]
    sharding = SingleDeviceSharding(device)
    chip = topology.chip
    sixteen_bit = jnp.dtype(description.get("dtype", "float32")).itemsize == 2
    peak = chip.peak_flops if sixteen_bit or not chip.peak_flops_fp32 else chip.peak_flops_fp32

    def on_device(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    def timer(forward, backward, args):
        args = on_device(args)
        seconds, flops = [], 0.0
        for fn in (forward, backward):
            lowered = jax.jit(fn).lower(*args)
            with no_cache_write_unless_here(device):
                cost = _cost_analysis(lowered.compile(), lowered, platform=device.platform)
            counted = float(cost.get("flops", 0.0))
            moved = float(cost.get("bytes accessed", 0.0))
            seconds.append(max(counted / peak, moved / chip.hbm_bandwidth))
            flops += counted
        return seconds[0], seconds[1], flops, jax.eval_shape(forward, *args)

    example = jax.ShapeDtypeStruct(example.shape, example.dtype, sharding=sharding)
    return profile_layers(
        model,
        example,
        optimizer,
        timer,
        description=description,
        device=f"{chip.name} ({topology.name}, compiler roofline)",
        source="compiler",
        progress=progress,
    )
