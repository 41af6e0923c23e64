"""Options for the accelerator's compiler that let gradient all-reduces overlap backward.

The train steps reduce gradients bucket by bucket so that each bucket can travel while
backward still computes the earlier layers (Poseidon's wait-free backprop). The schedules
built from collective permutes keep their buckets apart on their own. XLA's own all-reduce
(``allreduce="native"``) needs the TPU compiler told two
things, or it merges every bucket into one or two synchronous all-reduces after backward:

* combine only small all-reduces (up to 1 MiB: biases, BatchNorm parameters, running
  statistics, metrics), so that each large gradient keeps an all-reduce of its own;
* make all-reduces asynchronous, with the TPU's "async collective fusion", which fuses an
  all-reduce's progress into the compute the scheduler places beside it.

The options serve ``native`` steps only. Compiled with them, a step whose gradients travel by
collective permutes overlapped less of its backward pass in some programs (a small MLP with
BatchNorm on 32 chips: 57% of backward beside the gradients without them, 14% with them), so
such steps keep the compiler's defaults.

These are the options MaxText passes to the TPU compiler for data-parallel overlap. On TPU v4
the installed compiler runs out of vector memory (VMEM, 16 MiB) compiling such fusions even
for a small MLP's step, so v4 keeps the defaults: its buckets' all-reduces are merged and
synchronous, and the permute schedules are the way to overlap there.

XLA's GPU compiler makes all-reduces asynchronous by itself but combines them up to a large
threshold, so a ``native`` step on GPUs gets only the combiner limited to 1 MiB (ResNet-50 on
4 hosts of 8 H100s: 4 merged all-reduces and 6% of backward beside them by default, 43 and
50% with it). XLA:CPU gets no options.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = [
    "compiler_options_for",
]

TPU_OVERLAP_OPTIONS: dict[str, bool | int] = {
    "xla_enable_async_all_reduce": True,
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_jf_crs_combiner_threshold_in_bytes": 1 << 20,
}
GPU_OVERLAP_OPTIONS: dict[str, bool | int] = {
    "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 20,
}

# Device kinds whose compiler fails on the options above (see the module docstring).
_KEEP_DEFAULTS = ("TPU v4",)


def compiler_options_for(devices: Sequence[jax.Device], allreduce: str) -> dict | None:
    """The compiler options a step over ``devices`` whose gradients travel by ``allreduce``
    is compiled with (None: the compiler's defaults)."""
    first = next(iter(devices), None)
    if allreduce != "native" or first is None:
        return None
    if first.platform in ("gpu", "cuda"):
        return dict(GPU_OVERLAP_OPTIONS)
    if first.platform == "tpu" and first.device_kind not in _KEEP_DEFAULTS:
        return dict(TPU_OVERLAP_OPTIONS)
    return None
