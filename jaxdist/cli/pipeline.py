"""``jaxdist pipeline show``: a pipeline schedule's table, its bubble and the activations each
stage keeps, as text and as a timeline picture (``profile`` and ``partition``:
:mod:`jaxdist.cli.pipeline_partition`)."""

from __future__ import annotations

import argparse

from jaxdist.cli import pipeline_partition

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    pipeline = subparsers.add_parser("pipeline", help="pipeline-parallel schedules")
    actions = pipeline.add_subparsers(dest="pipeline_action", metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="draw a schedule's timeline: which stage runs which micro-batch at each tick",
        description="Build the table of a pipeline schedule (GPipe, 1F1B, interleaved 1F1B, "
        "or the asynchronous PipeDream and PipeDream-2BW, which run 1F1B's table) for STAGES "
        "devices and MICROBATCHES micro-batches, print it (F3: forward of "
        "micro-batch 3, B3.1: backward of micro-batch 3 on the device's model chunk 1, '.': "
        "idle), its bubble fraction against the formula, the most activations each "
        "stage keeps at once, and what the pipeline step's program makes of it: inputs "
        "stashed per device and messages between stages per step.",
    )
    show.add_argument("--stages", type=int, required=True, help="pipeline stages (devices)")
    show.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    show.add_argument(
        "--schedule",
        default="1f1b",
        help="gpipe, 1f1b, interleaved, pipedream or pipedream_2bw",
    )
    show.add_argument(
        "--chunks",
        type=int,
        default=2,
        help="model chunks per device for the interleaved schedule (default 2)",
    )
    show.add_argument("--plot", metavar="PNG", help="also draw the timeline to this file")
    show.set_defaults(func=show_schedule, joins_process_group=False)
    pipeline_partition.register(actions)
    pipeline.set_defaults(func=lambda args: pipeline.print_help() or 2, joins_process_group=False)


class ScheduleArgumentError(ValueError):
    """A schedule that cannot be built from the arguments given."""

    exit_code = 2


def show_schedule(args: argparse.Namespace) -> int:
    from jaxdist.pipeline import schedules
    from jaxdist.pipeline.program import compile_schedule

    try:
        schedule = schedules.build(args.schedule, args.stages, args.microbatches, args.chunks)
    except ValueError as err:
        raise ScheduleArgumentError(str(err)) from None
    formula = schedules.bubble_formula(
        schedule.name, schedule.stages, schedule.microbatches, schedule.chunks
    )
    chunks = f", {schedule.chunks} chunks per device" if schedule.name == "interleaved" else ""
    print(
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches"
        f"{chunks}; {schedule.ticks} ticks"
    )
    print(schedule.text())
    print(
        f"bubble: {schedule.bubble_fraction:.4f} of stage-ticks idle "
        f"(formula (S-1)/(v*M+S-1): {formula:.4f})"
    )
    live = ", ".join(map(str, schedule.live_activations()))
    print(f"most live activations per stage (micro-batch chunks): {live}")
    program = compile_schedule(schedule)
    print(
        f"the step's program: {program.input_slots} stashed inputs per device, "
        f"{program.messages_per_step} permutes per step "
        f"({int(program.sends_forward.sum())} forward, {int(program.sends_backward.sum())} "
        f"backward; one activation-sized message from every device in each)"
    )
    if schedule.name in schedules.ASYNCHRONOUS:
        print(asynchronous_versions(schedule.name, schedule.stages))
    if args.plot:
        plot_timeline(schedule, args.plot)
        print(f"wrote {args.plot}")
    return 0


def asynchronous_versions(name: str, stages: int) -> str:
    """What an asynchronous schedule keeps per stage: weight versions, and how many updates
    old its gradients are when applied (docs/pipeline.md)."""
    if name == "pipedream":
        rows = [
            f"  stage {s}: {stages - s} weight version(s), gradients {stages - s - 1} update(s) old"
            for s in range(stages)
        ]
        head = (
            "pipedream: 1F1B's table, each stage updating after every backward on the "
            "weights stashed at its forward"
        )
    else:
        rows = [f"  stage {s}: 2 weight versions, gradients 1 step old" for s in range(stages)]
        head = (
            "pipedream_2bw: 1F1B's table, every micro-batch on the weights one step older, "
            "one update per step"
        )
    return "\n".join([head, *rows])


def plot_timeline(schedule, path: str) -> None:
    """Draw ``schedule`` as boxes on a stage-by-tick grid (forwards blue, backwards orange,
    darker for later chunks) to ``path``."""
    from jaxdist.checks import pyplot

    plt = pyplot("jaxdist pipeline show --plot")

    fig, ax = plt.subplots(figsize=(max(6.0, schedule.ticks * 0.32), 1.0 + 0.5 * schedule.stages))
    for tick, row in enumerate(schedule.table):
        for stage, op in enumerate(row):
            if op is None:
                continue
            shade = 0.45 + 0.55 * (1 - op.chunk / max(1, schedule.chunks))
            color = (0.2, 0.45, 0.85, shade) if op.kind == "F" else (0.95, 0.55, 0.15, shade)
            ax.add_patch(plt.Rectangle((tick, stage), 1, 0.9, color=color))
            ax.text(
                tick + 0.5, stage + 0.45, str(op.microbatch), ha="center", va="center", fontsize=7
            )
    ax.set_xlim(0, schedule.ticks)
    ax.set_ylim(schedule.stages, 0)
    ax.set_yticks([s + 0.45 for s in range(schedule.stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel("tick (forward blue, backward orange; the number is the micro-batch)")
    ax.set_title(
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches, "
        f"bubble {schedule.bubble_fraction:.1%}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
