"""Compile a train step for devices that are not here and read what the compiler decided.

::

    topology = jaxdist.aot.parse_topology("v5e:2x2")
    mesh = Mesh(np.array(topology.devices()).reshape(2, 2), ("y", "x"))
    step = TrainStep(loss_fn, optax.sgd(0.1, 0.9), mesh, communication=Communication("torus2d"))
    report = compile_train_step(step, param_shapes, {}, {"image": ((128, 224, 224, 3), jnp.bfloat16), ...})
    report.memory.total, report.flops, report.schedule.by_kind()

Nothing is allocated: the state, the batch and the RNG key are ``jax.ShapeDtypeStruct`` with
their shardings, and ``jax.jit(...).lower(...).compile()`` runs the target's own compiler.
The figures are per chip and per step: memory from ``compiled.memory_analysis()``, FLOPs from
``compiled.cost_analysis()`` and the scheduled program from ``compiled.as_text()``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.aot.schedule import Schedule, read_schedule, rewritten_scatter_roles
from jaxdist.aot.timeline import matrix_flops
from jaxdist.comm import buckets as bucketing
from jaxdist.training.train_step import TrainStep

__all__ = [
    "CompiledStep",
    "DoesNotFitError",
    "MemoryPerChip",
    "compile_or_refuse",
    "compile_train_step",
    "memory_per_chip",
]


class DoesNotFitError(ValueError):
    """The compiler refused the step: it needs more memory than a chip has."""

    exit_code = 2


@dataclass(frozen=True)
class MemoryPerChip:
    """Device memory of one chip during a step, in bytes.

    ``arguments``, ``temp``, ``outputs`` and ``code`` are the compiler's own figures and add
    up to ``total``: ``arguments`` is the state's shards and the batch as laid out on the chip
    (tiled layouts pad small dimensions); ``temp`` is what the step allocates (activations kept
    for backward, gradients, communication buffers); ``outputs`` are results that cannot reuse
    an argument's buffer (none when the state is donated); ``code`` is the program.
    ``parameters``, ``optimizer_state`` and ``model_state`` say what of ``arguments`` is the
    state, from its shapes and shardings, before padding.
    """

    parameters: int
    optimizer_state: int
    model_state: int
    arguments: int
    temp: int
    outputs: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.temp + self.outputs + self.code


@dataclass
class CompiledStep:
    """What compiling one step told: time to compile, memory, FLOPs and the schedule."""

    compile_seconds: float
    memory: MemoryPerChip
    flops: float  # per chip per step, as the compiler counts them
    schedule: Schedule
    gradient_bytes: int  # bytes of the gradients each chip averages per step
    bucket_bytes: list[int]  # the same, per gradient bucket
    compiled: Any = None  # the jax Compiled object: as_text(), memory_analysis(), ...
    text: str = ""  # the scheduled program (compiled.as_text()), for jaxdist.aot.timeline
    num_devices: int = 1
    # the roles of reduce-scatters the compiler made all-reduces (schedule.rewritten_scatter_roles)
    scatter_roles: dict[int, str] = field(default_factory=dict)


@contextlib.contextmanager
def no_cache_write_unless_here(device: jax.Device) -> Iterator[None]:
    """Keep an executable for ``device`` out of JAX's persistent compilation cache unless the
    device is here: loading it back needs that device's client, so every later plan would
    fail to read it, warn, and compile again, and writing it costs serialisation and disk."""
    try:
        here = device in jax.devices(device.platform)
    except RuntimeError:  # no backend for that platform here: a topology compiled without it
        here = False
    if here:
        yield
        return
    name = "jax_persistent_cache_min_compile_time_secs"
    previous = getattr(jax.config, name)
    jax.config.update(name, math.inf)
    try:
        yield
    finally:
        jax.config.update(name, previous)


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of ``tree``'s leaves (``ShapeDtypeStruct`` with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.shape
        if getattr(leaf, "sharding", None) is not None:
            shape = leaf.sharding.shard_shape(shape)
        total += math.prod(shape) * _itemsize(leaf.dtype)
    return total


# Device platforms whose compiler's own cost analysis leaves out its library calls.
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _cost_analysis(compiled, lowered, text: str | None = None, *, platform: str = "") -> dict:
    """The compiler's cost analysis of the optimized program; on a GPU ``platform``, the
    FLOPs of the optimized program's matrix products and convolutions, cuDNN and cuBLAS calls
    included (:func:`~jaxdist.aot.timeline.matrix_flops`). The GPU compiler's own count leaves
    out most of what its library calls run (on an H200, 7.0 of a ResNet-50 training step's
    24 GFLOP per image) and it has none without a GPU, so a step priced on a GPU and one
    planned for it here count alike (a program whose products the compiler turned into
    broadcasts and reductions, by its products as traced). Elsewhere, a compiled program
    without an analysis is counted by XLA's generic analysis of the program as lowered, or
    else by its matrix products. The matrix count leaves out elementwise ops and, as the
    usual counts of ResNet FLOPs do, takes a convolution's taps on its padding too: 2% above
    the TPU compiler's own count of the same ResNet-50 step. ``text``: the compiled
    program's text, where the caller has it."""
    on_gpu = platform in GPU_PLATFORMS
    for analysed in () if on_gpu else (compiled, lowered):
        cost = _analysis(analysed)
        if cost:
            return cost
    flops = matrix_flops(compiled.as_text() if text is None else text)
    if flops:
        return {"flops": flops}
    # A program with no matrix product left (a model so small that the compiler turned its
    # products into broadcasts and reductions) is counted by its products as traced.
    flops = matrix_flops(lowered.as_text(dialect="hlo"))
    if flops:
        return {"flops": flops}
    raise RuntimeError(
        "neither the compiler nor a count of the compiled program's "
        "matrix products gave this step's FLOPs"
    )


def _analysis(program) -> dict | None:
    """A compiled or lowered program's cost analysis (one dict), or None."""
    cost = program.cost_analysis()
    return (cost[0] if cost else None) if isinstance(cost, list) else cost


def _step_flops(counted: float, text: str) -> float:
    """FLOPs of a step from the compiler's count, which takes a loop's body once: scaled as
    the compiled program's matrix products grow when each loop's body is counted once per
    turn. Scanned layers run their body once per layer; accumulation runs k - 1
    micro-batches in a loop and the last after it (the count holds two passes, the step k).
    Loops without products (a long ring's steps) change nothing."""
    once = matrix_flops(text)
    return counted * matrix_flops(text, every_turn=True) / once if once else counted


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key: two uint32 words
    return np.dtype(dtype).itemsize


# Options for a program that is compiled to be read, never run. The GPU compiler's LLVM
# optimisation of the kernels is most of a large program's compile time (a 7B
# tensor-parallel step on eight H100s: over 20 minutes with it, 36 s without), and everything a
# plan reads (the schedule, the buffers, the FLOPs) is fixed before it.
PLAN_ONLY_OPTIONS: dict[str, dict[str, int]] = {
    "gpu": {"xla_backend_optimization_level": 0},
    "cuda": {"xla_backend_optimization_level": 0},
}


def compile_or_refuse(lower: Callable[[], Any], device: jax.Device) -> tuple[Any, Any, float]:
    """``(lowered, compiled, seconds to lower and compile)`` of the program ``lower()``
    gives, compiled to be read (:data:`PLAN_ONLY_OPTIONS`), not run; :class:`DoesNotFitError`
    (the compiler's first line) where it cannot fit."""
    started = time.perf_counter()
    try:
        lowered = lower()
        with no_cache_write_unless_here(device):
            compiled = lowered.compile(PLAN_ONLY_OPTIONS.get(device.platform))
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise DoesNotFitError(str(err).splitlines()[0]) from err
    return lowered, compiled, time.perf_counter() - started


def memory_per_chip(state: Any, compiled: Any) -> MemoryPerChip:
    """A compiled step's memory per chip: the state's parts (shapes with shardings) and the
    compiler's own analysis of arguments, temporaries, outputs and code."""
    analysis = compiled.memory_analysis()
    return MemoryPerChip(
        parameters=per_chip_bytes(state.params),
        optimizer_state=per_chip_bytes(state.opt_state),
        model_state=per_chip_bytes(state.model_state),
        arguments=analysis.argument_size_in_bytes,
        temp=analysis.temp_size_in_bytes,
        outputs=max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes),
        code=analysis.generated_code_size_in_bytes,
    )


def abstract_batch(
    mesh: Mesh, data_axes: str | tuple[str, ...], shapes: dict[str, tuple[tuple[int, ...], Any]]
) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch as shapes, split over ``data_axes`` like ``TrainStep.shard_batch``:
    ``{"image": ((1024, 224, 224, 3), jnp.uint8), "label": ((1024,), jnp.int32)}``."""
    sharding = NamedSharding(mesh, P(data_axes))
    return {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for k, (shape, dtype) in shapes.items()
    }


def compile_train_step(
    step: TrainStep,
    params: Any,
    model_state: Any,
    batch: dict[str, tuple[tuple[int, ...], Any]] | dict[str, jax.ShapeDtypeStruct],
) -> CompiledStep:
    """Compile ``step`` for its mesh's devices from shapes alone and report per chip; raises
    :class:`DoesNotFitError` where the compiler finds the step cannot fit in a chip's memory.

    ``params`` and ``model_state`` may be arrays or shapes (e.g. from ``jax.eval_shape`` of
    the model's ``init``); ``batch`` maps each key to ``(global shape, dtype)`` or to a
    ``ShapeDtypeStruct``.
    """
    state = step.abstract_init(params, model_state)
    if any(not isinstance(v, jax.ShapeDtypeStruct) for v in batch.values()):
        batch = abstract_batch(step.mesh, step.data_axes, batch)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(step.mesh, P()))
    lowered, compiled, seconds = compile_or_refuse(
        lambda: step.lower(state, batch, rng), step.mesh.devices.flat[0]
    )
    memory = memory_per_chip(state, compiled)
    text = compiled.as_text()
    platform = step.mesh.devices.flat[0].platform
    scatter_roles = {}
    if platform == "tpu":  # the compiler that rewrites reduce-scatters
        traced = lowered.as_text(dialect="hlo", debug_info=True)
        scatter_roles = rewritten_scatter_roles(traced, step.mesh.size)
    cost = _cost_analysis(compiled, lowered, text, platform=platform)
    flops = _step_flops(float(cost.get("flops", 0.0)), text)
    sizes = bucketing.leaf_bytes(state.params)  # what the step's buckets are planned from
    buckets = step.buckets or [list(range(len(sizes)))]
    return CompiledStep(
        compile_seconds=seconds,
        memory=memory,
        flops=flops,
        schedule=read_schedule(text, step.mesh.size, scatter_roles),
        gradient_bytes=sum(sizes),
        bucket_bytes=[sum(sizes[i] for i in bucket) for bucket in buckets],
        compiled=compiled,
        text=text,
        num_devices=step.mesh.size,
        scatter_roles=scatter_roles,
    )
