"""Plan a recipe on a TPU slice before renting it: compile every batch-size stage's step for
the slice, read its memory, FLOPs and schedule, and predict step time and time-to-train.

::

    plan = plan_recipe(load_recipe("recipes/resnet50_imagenet_mlperf_lars.py"),
                       parse_topology("v5e:16x16"))
    plan.stages[0].compiled.memory.total, plan.total_seconds

The recipe's own mesh is used when it has as many devices as the slice has chips; otherwise
its layout is laid over the slice (``ring``: one axis of every chip; ``torus2d``: rows along
the slice's first dimension; ``torus3d``: the three dimensions of a v4 or v5p slice, its
first the inner axis; ``hierarchical``: rows of one host's chips). A recipe that
reads a dataset from disk is planned on a synthetic stand-in of the same image size and
ImageNet's size (1,281,167 images, 1000 classes), as nothing is read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_collections

from jaxdist import meshes
from jaxdist.aot import rcp, record
from jaxdist.aot.chips import GIB, network_for
from jaxdist.aot.compile import (
    CompiledStep,
    DoesNotFitError,
    compile_train_step,
    per_chip_bytes,
)
from jaxdist.aot.predict import StepTime, predict_step, time_to_train
from jaxdist.aot.topology import Topology
from jaxdist.aot.transformer_efficiency import fitted_efficiency
from jaxdist.aot.xla_fsdp import XlaFsdp, compile_xla_fsdp
from jaxdist.comm import cost_model
from jaxdist.data.config import SYNTHETIC_CLASSES
from jaxdist.run.build import RunParts, build_run
from jaxdist.tasks.image_classification import ImageClassification
from jaxdist.training.batch_schedule import DevicePlan

__all__ = [
    "LinkError",
    "MeshMismatchError",
    "PipelineNotPlannedError",
    "Plan",
    "StagePlan",
    "plan_recipe",
]

_READS_FROM_DISK = ("folder", "arrayrecord", "tfds", "hf")
FIT_HINT = (
    "lower max_per_device_batch (--set max_per_device_batch=N; --max-batch finds the largest "
    "that fits) or plan on more chips"
)


class PipelineNotPlannedError(ValueError):
    """A plan was asked of a pipeline recipe, which the time model does not cover."""

    exit_code = 2


class MeshMismatchError(ValueError):
    """A mesh given for a plan does not have one device per chip of the topology."""

    exit_code = 2


@dataclass
class StagePlan:
    """One batch-size stage: how its batch is split, what compiling it showed, its time."""

    index: int
    device_plan: DevicePlan
    compiled: CompiledStep
    step_time: StepTime
    # XLA's own FSDP of the same step (a sharded step's plan, unless asked not to).
    xla_fsdp: XlaFsdp | None = None


@dataclass
class Plan:
    """A recipe planned on a topology."""

    topology: Topology
    mesh_spec: meshes.MeshSpec
    mesh_note: str
    data_note: str
    algorithm: str
    network: object
    stages: list[StagePlan]
    epochs: float
    time_rows: list[dict] = field(default_factory=list)
    wait_free: bool = False  # gradient buckets paced beside backward (TrainStep(wait_free=...))
    gather: str = ""  # the parameters' all-gather schedule when not the allreduce's
    # Where each link class's figures come from ("fast", "host"): the chip table or a flag.
    link_sources: dict[str, str] = field(default_factory=dict)
    # What compiling another batch size needs (see largest_fitting_batch_of).
    parts: RunParts | None = field(default=None, repr=False)
    variable_shapes: tuple = field(default=(), repr=False)
    # For a ResNet-50 recipe: MLPerf's reference epochs at its batch (see reference_for).
    reference: dict | None = None
    # The task's own count of training FLOPs per example (a transformer's), if it has one.
    model_flops_per_example: float | None = None
    # What the step's compute was priced with, where the plan chose it (a transformer's fit).
    efficiency_note: str = ""

    @property
    def total_seconds(self) -> float:
        return sum(row["seconds"] for row in self.time_rows)

    @property
    def compile_seconds(self) -> float:
        return sum(s.compiled.compile_seconds for s in self.stages)


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


def stand_in_data(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str]:
    """The config with a synthetic source in place of one read from disk."""
    source = config.data.get("source")
    if source is None:
        return config, "the task's own data"
    if source not in _READS_FROM_DISK:
        return config, f"the recipe's {source!r} data"
    config = copy.deepcopy(config)
    config.data.source = "synthetic"
    config.data.root = None
    size = config.data.image_size
    note = (
        f"synthetic stand-in for the recipe's {source} data: "
        f"{config.data.synthetic_train_examples:,} images {size}x{size}x3, "
        f"{config.data.num_classes or SYNTHETIC_CLASSES} classes (nothing is read)"
    )
    return config, note


def plan_recipe(
    config: ml_collections.ConfigDict,
    topology: Topology,
    *,
    efficiency: float,
    mesh: str | None = None,
    link_latency: dict[str, float] | None = None,
    fast_link: str | None = None,
    host_link: str | None = None,
    on_stage: Callable[[int, DevicePlan], None] | None = None,
    task: Callable | None = None,
    transformer_efficiency: bool = False,
    xla_fsdp: bool = True,
    on_xla_fsdp: Callable[[int], None] | None = None,
) -> Plan:
    """Compile every batch-size stage of ``config`` for ``topology`` and predict its time.

    ``mesh`` (a preset or TOML path) replaces the recipe's; ``efficiency`` is the share of
    peak FLOP/s a step reaches (:mod:`jaxdist.aot.predict`); ``fast_link`` and ``host_link``
    (``"LATENCY:BANDWIDTH"``, one direction of one link) replace the chip table's links;
    ``on_stage`` is called before each stage compiles (for progress output); ``task`` is
    the recipe's ``get_task``, if it has one (:mod:`jaxdist.tasks`). With ``xla_fsdp``, a
    ZeRO-1 or FSDP stage is compiled a second time as XLA's own FSDP
    (:mod:`jaxdist.aot.xla_fsdp`), ``on_xla_fsdp`` called before, to print both memories.
    With ``transformer_efficiency``, a task that counts its model FLOPs (a transformer) has
    its compute priced at the chip generation's fitted model FLOPs utilization
    (:mod:`jaxdist.aot.transformer_efficiency`) instead of ``efficiency``.
    """
    from jaxdist.run import pipeline_config

    if pipeline_config.enabled(config):
        raise PipelineNotPlannedError(
            f"the recipe trains a {config.pipeline.stages}-stage pipeline, which the plan's "
            f"time model does not cover; for its memory per chip on a slice, run "
            f"benchmarks/pipeline_memory.py --topology {topology.name}"
        )
    config, data_note = stand_in_data(config)
    if mesh:
        spec, mesh_note = meshes.load(mesh), f"mesh {mesh!r} as given"
        check_mesh_matches(spec, topology)
    else:
        spec, mesh_note = mesh_spec_for(config.mesh, topology)
    parts = build_run(
        config,
        task_factory=task or ImageClassification,
        mesh=meshes.build(spec, topology.devices()),
    )
    params, model_state = _variable_shapes(parts, config)
    model_flops = parts.task.model_flops_per_example()
    fit = None
    if model_flops and transformer_efficiency:
        fit = fitted_efficiency(topology.generation)
    host_network = topology.chip.host_network if topology.network_groups > 1 else None
    network = network_for(topology.chip, host_network=host_network, latency=link_latency)
    network, link_sources = _given_links(network, topology, fast_link, host_link)
    stages = []
    for index, device_plan in enumerate(parts.plans):
        if on_stage is not None:
            on_stage(index, device_plan)
        variables = (params, model_state)
        utilization = None
        if fit is not None:
            per_chip = model_flops_per_chip(model_flops, device_plan, model_shared_by(parts))
            utilization = (fit.value, per_chip)
        stage = _plan_stage(
            parts,
            index,
            device_plan,
            variables,
            topology,
            network,
            efficiency=efficiency,
            utilization=utilization,
        )
        step = parts.train_step_for(index)
        if xla_fsdp and step.sharding != "replicated":
            if on_xla_fsdp is not None:
                on_xla_fsdp(index)
            batch = _batch_shapes(parts, device_plan.global_batch_size)
            stage.xla_fsdp = compile_xla_fsdp(step, *variables, batch)
        stages.append(stage)
    plan = Plan(
        topology,
        spec,
        mesh_note,
        data_note,
        config.allreduce,
        network,
        stages,
        config.num_epochs,
        wait_free=config.wait_free,
        gather=config.gather,
        link_sources=link_sources,
        parts=parts,
        variable_shapes=(params, model_state),
    )
    plan.model_flops_per_example = model_flops
    plan.efficiency_note = fit.describe() if fit is not None else ""
    step_seconds = [s.step_time.total for s in stages]
    plan.time_rows = time_to_train(parts.schedule, config.num_epochs, step_seconds)
    final = stages[-1]
    flops_per_image = final.compiled.flops / final.device_plan.per_device_batch
    plan.reference = reference_for(config, parts, step_seconds, topology, flops_per_image)
    return plan


def reference_for(
    config: ml_collections.ConfigDict,
    parts: RunParts,
    step_seconds: list,
    topology: Topology,
    flops_per_image: float,
) -> dict | None:
    """For a ResNet-50 recipe (MLPerf's benchmark), the reference convergence point at its
    global batch (:mod:`jaxdist.aot.rcp`): the epochs MLPerf expects, how they were found,
    the time to train at them, the hyperparameters the recipe sets otherwise than the
    reference runs at the nearest reference batch, and what the time model fitted on the
    MLPerf record predicts for ``topology`` (:func:`jaxdist.aot.record.record_time`; its
    images/s per chip as a share of the chip's peak at ``flops_per_image``). ``None`` for any
    other model."""
    if parts.task.name != "resnet50":
        return None
    found = rcp.epochs_to_converge(config.batch_size)
    final = parts.plans[-1]
    bn_span = final.per_device_batch * (config.model.get("bn_group_size") or parts.num_replicas)
    rows = [] if found.epochs is None else time_to_train(parts.schedule, found.epochs, step_seconds)
    differences = rcp.hyperparameter_differences(config, found.nearest, bn_span)
    return {
        "source": f"{rcp.RULESET} reference convergence points",
        "target": rcp.TARGET,
        "batch": config.batch_size,
        "epochs": found.epochs,
        "how": found.how,
        "recipe_epochs": config.num_epochs,
        "compared_with_batch": found.nearest.batch,
        "differences": [list(d) for d in differences],
        "time_rows": rows,
        "total_seconds": sum(row["seconds"] for row in rows),
        "record": _record_for(config.batch_size, topology, flops_per_image),
    }


def _record_for(global_batch: int, topology: Topology, flops_per_image: float) -> dict:
    answer = record.record_time(topology.generation, topology.num_chips, global_batch)
    fitted = answer.get("fitted")
    if fitted is not None:
        answer["share_of_peak"] = (
            fitted["images_per_second"] * flops_per_image / topology.chip.peak_flops
        )
    return answer


def _plan_stage(
    parts: RunParts,
    index: int,
    device_plan: DevicePlan,
    variables: tuple,
    topology: Topology,
    network,
    *,
    efficiency: float,
    utilization: tuple[float, float] | None = None,
) -> StagePlan:
    """Batch stage ``index`` compiled for ``topology`` and its step time predicted, its compute
    at ``efficiency`` of peak, or where ``utilization`` is ``(model FLOPs utilization, model
    FLOPs per chip per step)``, at the share of peak that has those FLOPs run at that
    utilization (a published utilization counts the model's FLOPs, whatever the step
    recomputes)."""
    try:
        compiled = _compile_at(parts, index, device_plan.global_batch_size, variables)
    except DoesNotFitError as err:
        raise DoesNotFitError(
            f"stage {index} (global batch {device_plan.global_batch_size:,}, "
            f"{device_plan.per_device_batch} per chip) does not fit on a "
            f"{topology.chip.name}: {err}; {sharding_hint(parts, index, variables)}{FIT_HINT}"
        ) from err
    if utilization is not None:
        share, model_flops = utilization
        efficiency = min(1.0, share * compiled.flops / model_flops)
    step_time = predict_step(
        compiled,
        topology.chip,
        efficiency=efficiency,
        network=network,
        fast_group=topology.chips_per_group if topology.network_groups > 1 else None,
    )
    return StagePlan(index, device_plan, compiled, step_time)


class LinkError(ValueError):
    """A link given for a plan that cannot be read or that the topology does not have."""

    exit_code = 2


def _given_links(
    network: cost_model.Network, topology: Topology, fast: str | None, host: str | None
) -> tuple[cost_model.Network, dict[str, str]]:
    """``network`` with the links a user gave in place of the chip table's, and where each
    link class's figures come from."""
    table = "published bandwidth (docs/planning.md, the chips), assumed latency"
    sources = {"fast": table}
    intra, inter = network.intra, network.inter
    if fast is not None:
        try:
            intra = cost_model.parse_link(fast, topology.chip.link_ports)
        except ValueError as err:
            raise LinkError(f"--fast-link: {err}") from err
        sources["fast"] = f"given: {fast}"
    if inter is not None:
        sources["host"] = table
    if host is not None:
        if inter is None:
            raise LinkError(
                f"--host-link: {topology.name} has no host network between its chips (one TPU "
                "slice: every chip is on the fast links); plan several slices (GEN:SHAPE/N) "
                "or GPU hosts to give one"
            )
        try:
            inter = cost_model.parse_link(host, 1)
        except ValueError as err:
            raise LinkError(f"--host-link: {err}") from err
        sources["host"] = f"given: {host}"
    return cost_model.Network(intra, inter), sources


def sharding_hint(parts: RunParts, stage: int, variable_shapes: tuple | None = None) -> str:
    """For a replicated data-parallel step, what its parameters and optimizer state weigh per
    chip and what FSDP would make of them ("" otherwise)."""
    step = parts.train_step_for(stage)
    if getattr(step, "sharding", None) != "replicated":
        return ""
    if variable_shapes is None:
        variable_shapes = _variable_shapes(parts, parts.config)
    state = step.abstract_init(*variable_shapes)
    held = per_chip_bytes((state.params, state.opt_state))
    chips = step.mesh.devices.size
    return (
        f"its parameters and optimizer state alone take {held / GIB:.2f} GiB per chip "
        f"replicated, {held / chips / GIB:.2f} GiB sharded over {chips} chips "
        f"(--set sharding=fsdp); or "
    )


def _variable_shapes(parts: RunParts, config) -> tuple[Any, Any]:
    """Parameter and model-state shapes of the recipe's model (nothing allocated)."""
    return jax.eval_shape(parts.task.init_variables, jax.random.key(config.seed))


def _compile_at(
    parts: RunParts, stage: int, global_batch: int, variable_shapes: tuple
) -> CompiledStep:
    """Compile stage ``stage``'s train step for a global batch of ``global_batch`` images."""
    step = parts.train_step_for(stage)
    return compile_train_step(step, *variable_shapes, _batch_shapes(parts, global_batch))


def model_flops_per_chip(
    model_flops_per_example: float, device_plan: DevicePlan, shared_by: int = 1
) -> float:
    """The model FLOPs one chip runs in a step: its examples (every micro-batch's) times the
    task's count per example, over the ``shared_by`` chips that split each example's model
    (a tensor axis's)."""
    examples = device_plan.per_device_batch * device_plan.accumulation_steps
    return model_flops_per_example * examples / shared_by


def model_shared_by(parts: RunParts) -> int:
    """How many chips split each example's model FLOPs: the size of the step's tensor axis
    (1 without one)."""
    step = parts.train_step_for(0)
    tensor = getattr(step, "tensor", None)
    return step.mesh.shape[tensor.axis] if tensor is not None else 1


def _batch_shapes(parts: RunParts, global_batch: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The task's train batch of ``global_batch`` records, as ``(shape, dtype)`` per key."""
    spec = parts.task.batch_spec(global_batch)
    return {name: (leaf.shape, leaf.dtype) for name, leaf in spec.items()}


def largest_fitting_batch_of(
    plan: Plan, on_try: Callable[[int, DevicePlan], None] | None = None
) -> tuple[int, dict[int, int | None]]:
    """:func:`largest_fitting_batch` for the first stage of a plan: per-chip batches compiled
    with the stage's accumulation, against the chip's HBM."""
    first = plan.stages[0].device_plan

    def memory_at(per_chip: int) -> int:
        global_batch = per_chip * first.num_devices * first.accumulation_steps
        if on_try is not None:
            on_try(
                0, DevicePlan(global_batch, first.num_devices, per_chip, first.accumulation_steps)
            )
        try:
            return _compile_at(plan.parts, 0, global_batch, plan.variable_shapes).memory.total
        except DoesNotFitError:
            return None

    return largest_fitting_batch(
        memory_at, int(plan.topology.chip.hbm_bytes), first.per_device_batch
    )


def largest_fitting_batch(
    memory_at: Callable[[int], int | None], capacity: int, start: int, limit: int = 1 << 16
) -> tuple[int, dict[int, int | None]]:
    """The largest per-chip batch whose step fits ``capacity`` bytes, by doubling from
    ``start`` and then bisection; ``memory_at(b)`` compiles at per-chip batch ``b`` and
    returns its bytes, or None where the compiler refused it. Returns the batch (0 if even 1
    does not fit) and every size tried."""
    tried: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = memory_at(b)
        return tried[b] is not None and tried[b] <= capacity

    low, high = 0, max(1, start)
    while fits(high):
        low, high = high, high * 2
        if high > limit:
            return low, tried
    if low == 0:
        low_try = 1
        if not fits(low_try):
            return 0, tried
        low = low_try
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, tried
