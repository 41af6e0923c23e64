"""``jaxdist plan RECIPE --topology v5e:16x16``: compile a recipe for a TPU slice that is not
here and print its memory, collectives, overlap and predicted time-to-train."""

from __future__ import annotations

import argparse
import json
import sys

from jaxdist.cli.train import add_set_argument

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="compile a recipe for a TPU slice without one: memory, overlap, time-to-train",
        description="Compile every batch-size stage of RECIPE with the TPU compiler for "
        "TOPOLOGY (no TPU needed: pip install 'jaxdist[tpu]') and print, per chip: HBM use "
        "against capacity, FLOPs per step, the scheduled collectives and the backward compute "
        "placed between their start and done; then a step time (compute at peak x a calibrated "
        "efficiency, plus the gradient communication the cost model says backward cannot hide) "
        "and the recipe's time-to-train over its epochs and batch stages.",
    )
    p.add_argument(
        "recipe", help="recipe file or name, e.g. recipes/resnet50_imagenet_mlperf_lars.py"
    )
    p.add_argument(
        "--topology",
        required=True,
        metavar="GEN:SHAPE[/SLICES]",
        help="TPU slice to compile for: v4, v5e, v5p or v6e with its shape in chips, e.g. "
        "v5e:16x16, v5p:12x12x24, v4:4x4x4; /N for N slices joined by the data-centre "
        "network; or GPU hosts, e.g. h100:4x8 (4 hosts of 8; needs JAX's CUDA plugin)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="mesh preset or TOML path (default: the "
        "recipe's when its size matches the slice, else its layout over the slice)",
    )
    add_set_argument(p, "max_per_device_batch=128")
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="share of peak FLOP/s a step reaches (default: for a transformer, the chip "
        "generation's model FLOPs utilization fitted on published transformer runs; else the "
        "generation's fitted on its published MLPerf runs, or for a generation without any "
        "the value calibrated on one TPU v4 run; see docs/planning.md)",
    )
    p.add_argument(
        "--fast-link",
        metavar="LATENCY:BANDWIDTH",
        default=None,
        help="the chips' fast links (ICI, NVLink), one direction of one link, e.g. "
        "2us:50GB/s (default: the chip table's published bandwidth and an assumed latency)",
    )
    p.add_argument(
        "--host-link",
        metavar="LATENCY:BANDWIDTH",
        default=None,
        help="the host network per chip between TPU slices or GPU hosts, e.g. 10us:3.1GB/s",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="also find the largest per-chip batch of the first stage that fits in HBM "
        "(compiles several times)",
    )
    p.add_argument(
        "--no-xla-fsdp",
        dest="xla_fsdp",
        action="store_false",
        help="skip compiling XLA's own FSDP of a ZeRO-1 or FSDP step (a plain jax.jit with "
        "the same placement), which the plan otherwise prints beside the step's memory; it "
        "about doubles the time a sharded plan takes",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan, joins_process_group=False)


def run_plan(args: argparse.Namespace) -> int:
    import jax

    # A plan compiles for the slice and runs nothing: JAX itself needs only the CPU.
    jax.config.update("jax_platforms", "cpu")
    from jaxdist.aot import published
    from jaxdist.aot.batch_search import largest_fitting_batch_of
    from jaxdist.aot.chips import GIB
    from jaxdist.aot.plan import plan_recipe
    from jaxdist.aot.report import plan_json, plan_text
    from jaxdist.aot.topology import parse_topology
    from jaxdist.run import config as config_lib

    topology = parse_topology(args.topology)
    path = config_lib.resolve_recipe_path(args.recipe)
    config = config_lib.apply_overrides(config_lib.load_recipe(path), args.overrides)
    if args.efficiency is not None:
        efficiency, note = args.efficiency, f"{args.efficiency:.2f} (--efficiency)"
    else:
        efficiency, note = published.calibrated_efficiency(topology.generation)

    def progress(index, device_plan):
        if not args.json:
            print(
                f"compiling stage {index} (global batch {device_plan.global_batch_size:,}) "
                f"for {topology.name} ...",
                file=sys.stderr,
                flush=True,
            )

    def progress_xla_fsdp(index):
        if not args.json:
            print(
                f"compiling XLA's own FSDP of stage {index} beside it (--no-xla-fsdp skips) ...",
                file=sys.stderr,
                flush=True,
            )

    plan = plan_recipe(
        config,
        topology,
        efficiency=efficiency,
        mesh=args.mesh,
        task=config_lib.recipe_task(path),
        fast_link=args.fast_link,
        host_link=args.host_link,
        on_stage=progress,
        xla_fsdp=args.xla_fsdp,
        on_xla_fsdp=progress_xla_fsdp,
        transformer_efficiency=args.efficiency is None,
    )
    fitting = largest_fitting_batch_of(plan, progress) if args.max_batch else None
    if args.json:
        data = plan_json(plan, note)
        if fitting is not None:
            data["largest_fitting_per_chip_batch"] = {"batch": fitting[0], "tried": fitting[1]}
        print(json.dumps(data, indent=2))
    else:
        print(plan_text(plan, note))
        if fitting is not None:
            batch, tried = fitting
            sizes = ", ".join(
                f"{b}: {'refused' if m is None else f'{m / GIB:.2f} GiB'}"
                for b, m in sorted(tried.items())
            )
            print(f"largest per-chip batch that fits (stage 0): {batch} (tried {sizes})")
    return _fit_verdict(plan)


def _fit_verdict(plan) -> int:
    """0 when every stage fits in HBM; otherwise one line naming the stage and the fix, 2."""
    from jaxdist.aot.chips import GIB
    from jaxdist.aot.plan import FIT_HINT, sharding_hint

    capacity = plan.topology.chip.hbm_bytes
    over = [s for s in plan.stages if s.compiled.memory.total > capacity]
    if not over:
        return 0
    worst = max(over, key=lambda s: s.compiled.memory.total)
    parts = getattr(plan, "parts", None)
    hint = sharding_hint(parts, worst.index) if parts is not None else ""
    excess = (worst.compiled.memory.total - capacity) / GIB
    print(
        f"jaxdist plan: stage {worst.index} needs {worst.compiled.memory.total / GIB:.2f} GiB "
        f"per chip, {excess:.2f} GiB more than a {plan.topology.chip.name}'s "
        f"{capacity / GIB:.2f} GiB: {hint}{FIT_HINT}",
        file=sys.stderr,
    )
    return 2
