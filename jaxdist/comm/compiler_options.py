"""Options for the accelerator's compiler that let gradient all-reduces overlap backward.

The train steps reduce gradients bucket by bucket so that each bucket can travel while
backward still computes the earlier layers (Poseidon's wait-free backprop). The schedules
built from collective permutes keep their buckets apart on their own. XLA's own all-reduce
(``allreduce="native"``) needs the TPU compiler told two things, or it merges every bucket
into one or two synchronous all-reduces after backward:

* combine only small all-reduces (biases, BatchNorm parameters, running statistics,
  metrics), so that each large gradient keeps an all-reduce of its own;
* make all-reduces asynchronous. How depends on the chip:

  - TPU v5p hands them to its SparseCores (a ``call-start``/``call-done`` pair on the
    SparseCore's thread), which run them while the TensorCore computes. The scheduler
    starts each as early as its estimate of the all-reduce's time asks for; at the
    default estimate it starts ResNet-50's buckets only after backward, so the options
    raise it (a latency multiplier), and each bucket starts once its gradients exist.
  - TPU v5e (no SparseCore) and v6e use the TPU's "async collective fusion", which fuses
    an all-reduce's progress into the compute the scheduler places beside it (the options
    MaxText passes for data-parallel overlap). Each such all-reduce runs beside one or two
    of backward's products, and it finds a fitting fusion for only some of a convolutional
    network's all-reduces; the rest stay synchronous. Combining only all-reduces under 64
    KiB gives each convolution's gradient its own all-reduce and so spreads them over more
    of backward (ResNet-50: 37 all-reduces at a 1 MiB threshold, 61 at 64 KiB).
  - TPU v4 keeps the compiler's defaults: the installed compiler runs out of vector memory
    (VMEM, 16 MiB) compiling async collective fusions, even for a small MLP's step, and
    does not offload all-reduces to its SparseCores. The permute schedules are the way to
    overlap there.
  - XLA's GPU compiler makes all-reduces asynchronous by itself; only its combiner
    threshold is limited. XLA:CPU gets no options.

The options serve ``native`` steps only. Compiled with them, a step whose gradients travel by
collective permutes overlapped less of its backward pass in some programs (a small MLP with
BatchNorm on 32 chips: 57% of backward beside the gradients without them, 14% with them), so
such steps keep the compiler's defaults.

A wait-free step on a TPU (each bucket's permute schedule paced beside backward,
:mod:`jaxdist.training.wait_free`) turns on the TPU scheduler's further features
(:data:`TPU_PACED_OPTIONS`). The pacing fixes which backward product bounds each message
step; where the step's receive waits between that bound and the step's start is the
scheduler's choice alone, and by default it waits for most of them before the product
between, with nothing beside them. With the further features it leaves more of them in flight
across a product: on ``v4:8x8x16`` (ResNet-50, the 3-D torus) 56% of the gradient time hidden
instead of 33%, and a step 9% shorter. docs/planning.md has each chip's measured overlap.
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
    "xla_jf_crs_combiner_threshold_in_bytes": 64 * 1024,
}
SPARSECORE_OVERLAP_OPTIONS: dict[str, bool | int] = {
    "xla_tpu_enable_sparse_core_collective_offload_all_reduce": True,
    # The scheduler's estimate of an offloaded all-reduce's time, multiplied: at 2 or less it
    # starts ResNet-50's buckets after backward, from 5 on as each bucket's gradients exist.
    "xla_tpu_sparse_core_all_reduce_latency_multiplier": 10,
    "xla_jf_crs_combiner_threshold_in_bytes": 1 << 20,
}
# The TPU scheduler's features beyond its defaults, for steps whose permute schedules are
# paced beside backward (see the module docstring).
TPU_PACED_OPTIONS: dict[str, bool | int] = {
    "xla_tpu_enable_all_experimental_scheduler_features": True,
}
GPU_OVERLAP_OPTIONS: dict[str, bool | int] = {
    "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 20,
}

# Device kinds whose compiler fails on the options above (see the module docstring).
_KEEP_DEFAULTS = ("TPU v4",)
# Device kinds whose all-reduces are offloaded to the SparseCores (TPU v5p).
_SPARSECORE_OFFLOAD = ("TPU v5",)


def compiler_options_for(
    devices: Sequence[jax.Device], allreduce: str, wait_free: bool = False
) -> dict | None:
    """The compiler options a step over ``devices`` whose gradients travel by ``allreduce``
    (paced beside backward if ``wait_free``) is compiled with (None: the compiler's
    defaults)."""
    first = next(iter(devices), None)
    if first is None:
        return None
    if allreduce != "native":
        return dict(TPU_PACED_OPTIONS) if wait_free and first.platform == "tpu" else None
    if first.platform in ("gpu", "cuda"):
        return dict(GPU_OVERLAP_OPTIONS)
    if first.platform == "tpu" and first.device_kind in _SPARSECORE_OFFLOAD:
        return dict(SPARSECORE_OVERLAP_OPTIONS)
    if first.platform == "tpu" and first.device_kind not in _KEEP_DEFAULTS:
        return dict(TPU_OVERLAP_OPTIONS)
    return None
