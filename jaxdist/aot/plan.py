"""Plan a recipe on a TPU slice before renting it: compile every batch-size stage's step for
the slice, read its memory, FLOPs and schedule, and predict step time and time-to-train.

::

    plan = plan_recipe(load_recipe("recipes/resnet50_imagenet_mlperf_lars.py"),
                       parse_topology("v5e:16x16"))
    plan.stages[0].compiled.memory.total, plan.total_seconds

The run's parts are built as a run builds them (:func:`~jaxdist.run.build.build_run`), on the
mesh :mod:`~jaxdist.aot.slice_mesh` lays over the slice and the data
:mod:`~jaxdist.aot.stand_in` puts in place of a dataset on disk; a ResNet-50 recipe is set
against MLPerf's reference (:mod:`~jaxdist.aot.plan_reference`); ``--max-batch`` searches
with :mod:`~jaxdist.aot.batch_search`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_collections

from jaxdist import meshes
from jaxdist.aot.chips import GIB, network_for
from jaxdist.aot.compile import (
    CompiledStep,
    DoesNotFitError,
    compile_train_step,
    per_chip_bytes,
)
from jaxdist.aot.plan_reference import reference_for
from jaxdist.aot.predict import StepTime, predict_step, time_to_train
from jaxdist.aot.slice_mesh import check_mesh_matches, mesh_spec_for
from jaxdist.aot.stand_in import stand_in_data
from jaxdist.aot.topology import Topology
from jaxdist.aot.transformer_efficiency import fitted_efficiency
from jaxdist.aot.xla_fsdp import XlaFsdp, compile_xla_fsdp
from jaxdist.comm import cost_model
from jaxdist.run.build import RunParts, build_run
from jaxdist.tasks.image_classification import ImageClassification
from jaxdist.training import logical_axes
from jaxdist.training.batch_schedule import DevicePlan
from jaxdist.training.train_step import TrainStep

__all__ = [
    "LinkError",
    "PipelineNotPlannedError",
    "Plan",
    "StagePlan",
    "plan_recipe",
]

FIT_HINT = (
    "lower max_per_device_batch (--set max_per_device_batch=N; --max-batch finds the largest "
    "that fits) or plan on more chips"
)


class PipelineNotPlannedError(ValueError):
    """A plan was asked of a pipeline recipe, which the time model does not cover."""

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
    wait_free: bool = False  # gradient buckets paced beside backward (Communication(wait_free=...))
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
        if xla_fsdp and step.sharding.sharded:
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
        compiled = compile_at(parts, index, device_plan.global_batch_size, variables)
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
    chip and what FSDP would make of them; for a sharded one whose layers compute in
    bfloat16 while its gradients travel in float32, the setting that halves them ("" else).
    Before either, for a tensor-parallel step that keeps a vocabulary whole on every device
    of its tensor axis, the rule that splits it."""
    step = parts.train_step_for(stage)
    if not isinstance(step, TrainStep):
        return ""
    return _vocabulary_hint(parts, step, variable_shapes) + _state_hint(
        parts, step, variable_shapes
    )


def _vocabulary_hint(parts: RunParts, step: TrainStep, variable_shapes: tuple | None) -> str:
    """The rule that splits a vocabulary a tensor-parallel step keeps whole, where the axis
    divides it ("" else)."""
    task = getattr(parts, "task", None)  # a plan's parts have one; a bare step does not
    if step.tensor is None or step.tensor.vocabulary or task is None:
        return ""
    axes = task.logical_axes()
    if axes is None or axes.vocabulary is None:
        return ""
    if variable_shapes is None:
        variable_shapes = _variable_shapes(parts, parts.config)
    rules = ((axes.vocabulary, step.tensor.axis),)
    try:
        size = step.mesh.shape[step.tensor.axis]
        logical_axes.split_dims(axes.names, rules, step.tensor.axis, variable_shapes[0], size)
    except ValueError:  # the axis does not divide the vocabulary: the rule would be refused
        return ""
    return (
        f"its vocabulary is whole on every device of the tensor axis (the rule "
        f"{axes.vocabulary}=tensor in --set logical_axis_rules splits the embedding, the "
        f"head and the logits); or "
    )


def _state_hint(parts: RunParts, step: TrainStep, variable_shapes: tuple | None) -> str:
    if step.sharding.sharded:
        model = getattr(parts.config, "model", None)
        if getattr(model, "dtype", None) != "bfloat16":
            return ""
        if step.communication.options.get("transfer_dtype") is not None:
            return ""
        return (
            "its layers compute in bfloat16 and its gradients travel in float32 "
            "(--set transfer_dtype=bfloat16 halves their bytes and, under native, the "
            "buffers of their reduce-scatters); or "
        )
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


def compile_at(
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
