"""A :class:`~jaxdist.aot.plan.Plan` as the text ``jaxdist plan`` prints, or as JSON."""

from __future__ import annotations

from typing import Any

from jaxdist import meshes
from jaxdist.aot.chips import GIB
from jaxdist.aot.placement import placement_rows, state_bytes_per_chip
from jaxdist.aot.plan import Plan, StagePlan, model_flops_per_chip, model_shared_by
from jaxdist.aot.topology import Topology
from jaxdist.aot.xla_fsdp import XlaFsdp
from jaxdist.run.log import format_duration

__all__ = ["plan_json", "plan_text"]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _xla_fsdp_lines(xla: XlaFsdp | None, ours: int) -> list[str]:
    """One line setting XLA's own FSDP of the step beside ours (none where not compiled)."""
    if xla is None:
        return []
    head = "  XLA's own FSDP of this step (a plain jax.jit, the same placement):"
    if xla.memory is None:
        return [f"{head} does not fit ({xla.refusal}); compiled in {xla.compile_seconds:.1f} s"]
    theirs = xla.memory
    return [
        f"{head} total {_gib(theirs.total)} GiB (activations and temp {_gib(theirs.temp)}, "
        f"code {_gib(theirs.code)}); ours {ours / theirs.total:.2f}x it; compiled in "
        f"{xla.compile_seconds:.1f} s"
    ]


def _xla_fsdp_json(xla: XlaFsdp | None) -> dict | None:
    if xla is None:
        return None
    memory = None if xla.memory is None else {**xla.memory.__dict__, "total": xla.memory.total}
    return {"memory_bytes": memory, "refusal": xla.refusal, "compile_seconds": xla.compile_seconds}


def _fit_line(total: int, capacity: float) -> str:
    if total <= capacity:
        return f"fits ({(capacity - total) / GIB:.2f} GiB free)"
    return f"does not fit by {(total - capacity) / GIB:.2f} GiB"


def torus3d_hint(topology: Topology, spec: meshes.MeshSpec, algorithm: str) -> str | None:
    """A line pointing a 2-D torus on a 3-D TPU slice to the 3-D torus along the slice's own
    dimensions, when that takes fewer dependent steps a bucket (None otherwise)."""
    if algorithm != "torus2d" or topology.is_gpu or topology.slices > 1:
        return None
    if len(topology.shape) != 3 or len(spec.shape) != 2:
        return None
    planar = 2 * (sum(spec.shape) - 2)
    cubic = 2 * (sum(topology.shape) - 3)
    if cubic >= planar:
        return None
    return (
        f"  a 3-D torus along the slice's dimensions takes {cubic} dependent steps a bucket "
        f"where this {' x '.join(map(str, spec.shape))} torus takes {planar}: --set "
        "mesh=torus-2x2x2 --set allreduce=torus3d"
    )


def model_flops_utilization(plan: Plan, stage: StagePlan) -> float | None:
    """The stage's model FLOPs per chip per second over the chip's peak (a task that counts
    its model FLOPs, a transformer's), or None."""
    if not plan.model_flops_per_example:
        return None
    per_chip = model_flops_per_chip(
        plan.model_flops_per_example,
        stage.device_plan,
        model_shared_by(plan.parts) if plan.parts is not None else 1,
    )
    return per_chip / stage.step_time.total / plan.topology.chip.peak_flops


def _utilization_lines(plan: Plan, stage: StagePlan) -> list[str]:
    utilization = model_flops_utilization(plan, stage)
    if utilization is None:
        return []
    line = (
        f"  model FLOPs utilization: {utilization:.1%} "
        f"({plan.model_flops_per_example:.3e} model FLOPs a {_unit(plan)[:-1]}, MaxText's count)"
    )
    seq_len = plan.parts.task.describe().get("seq_len") if plan.parts is not None else None
    if seq_len:
        tokens = stage.device_plan.global_batch_size * seq_len / stage.step_time.total
        line += f"; {tokens:,.0f} tokens/s, {tokens / plan.topology.num_chips:,.0f} per chip"
    return [line]


def _unit(plan: Plan) -> str:
    """What the task calls one example (images, sequences, samples)."""
    return getattr(getattr(plan.parts, "task", None), "unit", "samples")


def _sharding(plan: Plan) -> str:
    parts = plan.parts
    return parts.step_parts.sharding.kind if parts is not None else "replicated"


def _sharding_lines(plan: Plan, t: Any) -> list[str]:
    """A sharded plan: what is split and kept whole, and the parameter gathers' time."""
    sharding = _sharding(plan)
    if sharding == "replicated":
        return []
    step = plan.parts.train_step_for(0)
    lines = [f"  sharding: {sharding}: {step.placement.describe()}"]
    if step.paced_layers is not None:
        prefetch = step.sharding.prefetch
        ahead = "one layer" if prefetch == 1 else f"{prefetch} layers"
        lines.append(
            f"  fsdp's gathers: the loss cut into {step.paced_layers} layers, each "
            f"gathered {ahead} ahead of its use, in forward and again in backward"
        )
    if t.parameter_communication:
        share = t.parameter_hidden / t.parameter_communication
        lines.append(
            f"  parameter gathers: {t.parameter_communication * 1e3:.2f} ms, of which "
            f"{t.parameter_hidden * 1e3:.2f} ms ({share:.0%}) run beside compute"
        )
        both = t.communication + t.parameter_communication
        hidden = t.hidden + t.parameter_hidden
        lines.append(
            f"  {sharding}'s collectives (gradients and parameters): {both * 1e3:.2f} ms, "
            f"{hidden / both:.0%} hidden"
        )
    return lines


def _tensor_lines(plan: Plan, t: Any) -> list[str]:
    """A tensor-parallel plan: the axis and schedule, the memory the axis saves, and the
    summed products' transfer time with its share beside compute."""
    step = plan.parts.train_step_for(0) if plan.parts is not None else None
    tensor = getattr(step, "tensor", None)
    if tensor is None:
        return []
    state = step.abstract_init(*plan.variable_shapes)
    held = state_bytes_per_chip(state)
    whole = state_bytes_per_chip(state, ignoring=tensor.axis)
    size = step.mesh.shape[tensor.axis]
    lines = [
        f"  tensor parallelism: {tensor.axis}={size}, schedule {tensor.schedule}"
        f"{', positions split between the products' if tensor.sequence else ''}; parameters "
        f"and optimizer state {_gib(held)} GiB per chip, {_gib(whole)} GiB were the "
        f"{tensor.axis} axis to split nothing"
    ]
    if t.tensor_communication:
        share = t.tensor_hidden / t.tensor_communication
        lines.append(
            f"  tensor-parallel communication: {t.tensor_communication * 1e3:.2f} ms, of which "
            f"{t.tensor_hidden * 1e3:.2f} ms ({share:.0%}) run beside compute"
        )
    return lines


def _places_parameters(plan: Plan) -> bool:
    """Whether the plan's step splits any parameter (sharded or tensor-parallel)."""
    if plan.parts is None:
        return False
    step = plan.parts.train_step_for(0)
    return _sharding(plan) != "replicated" or getattr(step, "tensor", None) is not None


def placement_lines(plan: Plan) -> list[str]:
    """Where the plan's step keeps each parameter (one row per kind of leaf)."""
    step = plan.parts.train_step_for(0)
    rows = placement_rows(step, *plan.variable_shapes)
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"placement over {dict(step.mesh.shape)} (parameter, global shape, PartitionSpec;"
        " optimizer state alike):"
    ]
    lines += [f"  {name:<{width}}  {shape:<18} {spec}" for name, shape, spec in rows]
    return lines


def _parameters_exposed(t: Any) -> str:
    if not t.parameter_communication:
        return ""
    return f", parameters' {(t.parameter_communication - t.parameter_hidden) * 1e3:.1f} ms"


def _stage_lines(plan: Plan, stage: StagePlan) -> list[str]:
    chip = plan.topology.chip
    dp, mem, t = stage.device_plan, stage.compiled.memory, stage.step_time
    accumulation = f" x {dp.accumulation_steps} accumulated" if dp.accumulation_steps > 1 else ""
    lines = [
        f"stage {stage.index}: global batch {dp.global_batch_size:,} = {dp.num_devices} chips x "
        f"{dp.per_device_batch}{accumulation}; compiled in {stage.compiled.compile_seconds:.1f} s",
        f"  HBM per chip (GiB): parameters {_gib(mem.parameters)}, optimizer state "
        f"{_gib(mem.optimizer_state)}, model state {_gib(mem.model_state)} "
        f"(all arguments with the batch {_gib(mem.arguments)}); activations and temp "
        f"{_gib(mem.temp)}; outputs {_gib(mem.outputs)}; code {_gib(mem.code)}",
        f"  total {_gib(mem.total)} of {_gib(chip.hbm_bytes)} GiB: "
        f"{_fit_line(mem.total, chip.hbm_bytes)}",
        *_xla_fsdp_lines(stage.xla_fsdp, mem.total),
        f"  FLOPs per chip per step: {stage.compiled.flops:.3e}",
        "  collectives per step (role, kind: count, MiB per chip, async, inside a loop, with "
        "backward inside, most backward matmuls inside one):",
    ]
    schedule = stage.compiled.schedule
    for row in schedule.by_kind():
        lines.append(
            f"    {row['role']:<10} {row['kind']:<19} {row['count']:>5} {row['bytes'] / 2**20:>10.2f}"
            f" {row['async']:>5} {row['in_loop']:>5} {row['with_backward_inside']:>5}"
            f" {row['most_backward_inside']:>5}"
        )
    for source, count in sorted(schedule.unexplained_sources().items(), key=lambda kv: -kv[1]):
        lines.append(f"    other: {count} per step from {source}")
    # Loops of collectives alone (a ring's steps rolled up); a scanned model's loop runs its
    # layers' products beside its collectives.
    looped = sum(
        c.turns for c in schedule.gradient_collectives if c.in_loop and not c.loop_computes
    )
    if looped and plan.parts is not None:
        longest = max(plan.mesh_spec.shape)
        limit = plan.parts.step_parts.communication.options["unroll_limit"]
        lines.append(
            f"  note: {looped:,} gradient collectives per step run inside loops (rings longer "
            f"than unroll_limit={limit}) and hide nothing; "
            f"--set unroll_limit={longest} unrolls them (the program compiles for longer)"
        )
    lines += _sharding_lines(plan, t)
    lines += _tensor_lines(plan, t)
    lines += [
        f"  gradient communication: {t.communication * 1e3:.2f} ms, of which "
        f"{t.hidden * 1e3:.2f} ms ({t.hidden_fraction:.0%}) run beside compute (the compiled "
        "order walked as the chip runs it)",
        f"  backward matmuls inside a gradient collective's start..done window: "
        f"{schedule.backward_during_gradients} of {schedule.backward_matmuls} "
        f"({schedule.overlapped_backward_fraction:.0%}; a count, not time)",
        f"  step: compute {t.compute * 1e3:.1f} ms (FLOPs at peak x efficiency "
        f"{t.efficiency:.2f}) + waiting for communication {t.exposed * 1e3:.1f} ms (gradients' "
        f"exposed {(t.communication - t.hidden) * 1e3:.1f} ms{_parameters_exposed(t)}, other "
        f"collectives {t.other * 1e3:.1f} ms) = {t.total * 1e3:.1f} ms -> "
        f"{dp.global_batch_size / t.total:,.0f} {_unit(plan)}/s",
        *_utilization_lines(plan, stage),
    ]
    replicated = _sharding(plan) == "replicated"
    if (
        not plan.wait_free
        and plan.algorithm not in ("native", "auto")
        and t.communication
        and replicated
    ):
        lines.append(
            "  note: the buckets' schedules run in the compiler's order; --set wait_free=True "
            "paces each bucket's steps beside the backward pass (docs/train_step.md)"
        )
    if t.other_by_role:
        parts = ", ".join(f"{role} {s * 1e3:.2f}" for role, s in t.other_by_role.items())
        lines.append(f"  other collectives per step (ms): {parts}")
    return lines


def plan_text(plan: Plan, efficiency_note: str) -> str:
    """The plan as ``jaxdist plan`` prints it."""
    topo, chip = plan.topology, plan.topology.chip
    network = plan.network
    fast = "ICI" if chip.torus_dims else "NVLink"
    sources = plan.link_sources
    links = f"{fast} {1 / network.intra.beta / 1e9:g} GB/s per direction x "
    links += f"{network.intra.ports} port(s), latency {network.intra.alpha * 1e6:g} us "
    links += f"({sources.get('fast', '')}; --fast-link to change)"
    if network.inter is not None:
        slow = "DCN" if chip.torus_dims else "host network"
        links += (
            f"; {slow} {1 / network.inter.beta / 1e9:g} GB/s per chip, latency "
            f"{network.inter.alpha * 1e6:g} us ({sources.get('host', '')}; --host-link to change)"
        )
    gathered = f" (parameters all-gathered by {plan.gather})" if plan.gather else ""
    lines = [
        f"topology: {topo.name}: {topo.num_chips} x {chip.name} ({_gib(chip.hbm_bytes)} GiB HBM, "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s bf16 each), {topo.num_hosts} hosts",
        f"{meshes.summary(plan.mesh_spec).splitlines()[0]} -- {plan.mesh_note}",
        f"data: {plan.data_note}",
        f"allreduce: {plan.algorithm}{gathered}; links: {links}",
        *filter(None, [torus3d_hint(topo, plan.mesh_spec, plan.algorithm)]),
        "link model: alpha-beta (jaxdist.comm.cost_model); gradients travel as "
        + ("the compiler's all-reduce" if plan.algorithm == "native" else "the step's schedule")
        + (", wait-free" if plan.wait_free else "")
        + "; every collective of the compiled program priced by its kind, bytes and group and "
        "walked in the compiler's order",
        f"efficiency: {plan.efficiency_note or efficiency_note}",
        f"compiled {len(plan.stages)} stage(s) in {plan.compile_seconds:.1f} s",
        "",
    ]
    if _places_parameters(plan):
        lines += [*placement_lines(plan), ""]
    for stage in plan.stages:
        lines += [*_stage_lines(plan, stage), ""]
    lines.append(f"time to train {plan.epochs:g} epochs (steps only: no input, eval or start-up):")
    for row in plan.time_rows:
        lines.append(
            f"  stage {row['stage']}: batch {row['global_batch']:>7,} x {row['steps']:>6,} steps "
            f"x {row['step_seconds'] * 1e3:7.1f} ms = {format_duration(row['seconds'])} "
            f"({row['images_per_second']:,.0f} {_unit(plan)}/s)"
        )
    lines.append(f"  total: {format_duration(plan.total_seconds)}")
    lines += _reference_lines(plan.reference)
    return "\n".join(lines)


def _reference_lines(ref: dict | None) -> list[str]:
    """MLPerf's reference epochs at the recipe's batch, the time at them, and the recipe's
    hyperparameters that differ from the reference runs'."""
    if ref is None:
        return []
    head = f"MLPerf reference ({ref['source']}) at global batch {ref['batch']:,}: "
    if ref["epochs"] is None:
        return [
            "",
            head + f"none ({ref['how']}); the recipe's num_epochs: {ref['recipe_epochs']:g}",
        ]
    lines = [
        "",
        head + f"{ref['epochs']:.1f} epochs to {ref['target']} ({ref['how']}); "
        f"the recipe's num_epochs: {ref['recipe_epochs']:g}",
        f"  time to train at {ref['epochs']:.1f} epochs: {format_duration(ref['total_seconds'])}",
    ]
    lines += _record_lines(ref.get("record"))
    if ref["differences"]:
        shown = "; ".join(
            f"{name} {mine} (reference {theirs})" for name, mine, theirs in ref["differences"]
        )
        lines.append(
            f"  set otherwise than the reference runs at {ref['compared_with_batch']:,}: {shown}"
        )
    return lines


def _record_lines(found: dict | None) -> list[str]:
    """What the time model fitted on the MLPerf record says of this run, and where the run
    lies outside what the record covers."""
    if found is None:
        return []
    if found["seconds"] is None:
        return [f"  the MLPerf record's model: no prediction ({'; '.join(found['outside'])})"]
    fitted = found["fitted"]
    low, high = fitted["chips"]
    share = found.get("share_of_peak")
    share = f", {share:.0%} of peak at this step's FLOPs" if share is not None else ""
    lines = [
        f"  the MLPerf record's model: {format_duration(found['seconds'])} at "
        f"{found['epochs']:.1f} epochs ({fitted['images_per_second']:,.0f} images/s per "
        f"{found['generation']} chip{share}, {fitted['step_overhead'] * 1e3:.1f} ms a step; "
        f"fitted on its {fitted['submissions']} submissions of {low:,}-{high:,} chips)"
    ]
    lines += [f"  outside the record: {why}" for why in found["outside"]]
    return lines


def _link_json(link) -> dict:
    return {"latency_s": link.alpha, "bytes_per_s": link.bandwidth, "ports": link.ports}


def plan_json(plan: Plan, efficiency_note: str) -> dict:
    """The plan as plain data (``jaxdist plan --json``)."""
    stages = []
    for stage in plan.stages:
        mem, t = stage.compiled.memory, stage.step_time
        stages.append(
            {
                "stage": stage.index,
                "global_batch": stage.device_plan.global_batch_size,
                "per_chip_batch": stage.device_plan.per_device_batch,
                "accumulation_steps": stage.device_plan.accumulation_steps,
                "compile_seconds": stage.compiled.compile_seconds,
                "memory_bytes": {
                    **mem.__dict__,
                    "total": mem.total,
                    "capacity": plan.topology.chip.hbm_bytes,
                },
                "fits": mem.total <= plan.topology.chip.hbm_bytes,
                "model_flops_utilization": model_flops_utilization(plan, stage),
                "xla_fsdp": _xla_fsdp_json(stage.xla_fsdp),
                "flops_per_chip": stage.compiled.flops,
                "collectives": stage.compiled.schedule.by_kind(),
                "overlapped_backward_fraction": stage.compiled.schedule.overlapped_backward_fraction,
                "gradient_bytes": stage.compiled.gradient_bytes,
                "unexplained_collectives": stage.compiled.schedule.unexplained_sources(),
                "gradient_hidden_fraction": t.hidden_fraction,
                "step_seconds": {
                    "compute": t.compute,
                    "communication": t.communication,
                    "hidden": t.hidden,
                    "exposed": t.exposed,
                    "other": t.other,
                    "other_by_role": t.other_by_role,
                    "total": t.total,
                    "tensor_hidden": t.tensor_hidden,
                },
            }
        )
    return {
        "topology": plan.topology.name,
        "chips": plan.topology.num_chips,
        "chip": plan.topology.chip.name,
        "mesh": dict(plan.mesh_spec.axes),
        "mesh_note": plan.mesh_note,
        "data": plan.data_note,
        "allreduce": plan.algorithm,
        "gather": plan.gather or plan.algorithm,
        "links": {
            "fast": _link_json(plan.network.intra),
            "host": None if plan.network.inter is None else _link_json(plan.network.inter),
            "sources": plan.link_sources,
        },
        "efficiency": plan.efficiency_note or efficiency_note,
        "stages": stages,
        "time_to_train": plan.time_rows,
        "total_seconds": plan.total_seconds,
        "mlperf_reference": plan.reference,
        "placement": (
            [
                dict(zip(("parameter", "shape", "spec"), row))
                for row in placement_rows(plan.parts.train_step_for(0), *plan.variable_shapes)
            ]
            if _places_parameters(plan)
            else None
        ),
    }
