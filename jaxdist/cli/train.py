"""``jaxdist train RECIPE [--workdir DIR] [--set key=value ...]``."""

from __future__ import annotations

import argparse
from pathlib import Path

# The command line is the interface; nothing here is for import.
__all__: list[str] = []

# Exit status of a run stopped by SIGTERM after saving its checkpoint (128 + 15, the shell's
# convention), so a job scheduler sees that it did not finish.
PREEMPTED_EXIT_CODE = 143
INTERRUPTED_EXIT_CODE = 130  # Ctrl-C (SIGINT): 128 + 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a recipe (resumes from the workdir's newest checkpoint)",
        description="Train the recipe file RECIPE (a path, or a name in recipes/). Metrics go "
        "to WORKDIR/metrics.jsonl, the MLPerf event log to WORKDIR/events.log, "
        "checkpoints to WORKDIR/checkpoints and the resolved config to WORKDIR/config.json. "
        "A rerun resumes the newest checkpoint there if its config is the same (max_steps, "
        "a larger num_epochs and the logging, eval and checkpoint intervals may change).",
    )
    p.add_argument("recipe", help="recipe file or name, e.g. recipes/mnist_small_batch.py")
    p.add_argument("--workdir", default=None, help="run directory (default runs/<recipe name>)")
    add_set_argument(p, "data.source=synthetic")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="check the config as a run would (mesh, data, batch plan, model, optimizer), "
        "print it and exit",
    )
    p.add_argument(
        "--profile-steps",
        metavar="FIRST:LAST",
        default=None,
        help="write a jax.profiler trace of steps FIRST to LAST (as the progress lines number "
        "them) to WORKDIR/profile, for TensorBoard's profile plugin, XProf or Perfetto",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a workdir whose run was started with another config; the change is "
        "recorded in WORKDIR/config_changes.jsonl and events.log",
    )
    p.set_defaults(func=run_train)


def add_set_argument(p: argparse.ArgumentParser, example: str) -> None:
    """``--set KEY=VALUE`` (repeatable): a recipe's field overridden on the command line."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field, e.g. --set {example} (repeatable)",
    )


def run_train(args: argparse.Namespace) -> int:
    from jaxdist.run import config as config_lib
    from jaxdist.run.profile import parse_profile_steps

    steps = None if args.profile_steps is None else parse_profile_steps(args.profile_steps)
    path = config_lib.resolve_recipe_path(args.recipe)
    config = config_lib.apply_overrides(config_lib.load_recipe(path), args.overrides)
    import jax

    from jaxdist.meshes import MeshDoesNotFitError
    from jaxdist.run.trainer import Trainer
    from jaxdist.runtime import distributed

    workdir = Path(args.workdir or Path("runs") / path.stem)
    try:
        trainer = Trainer(
            config,
            workdir,
            allow_config_change=args.allow_config_change,
            task=config_lib.recipe_task(path),
            recipe=path,
            profile_steps=steps,
        )
    except MeshDoesNotFitError:
        # The same for every process (it compares the mesh with the run's devices): said
        # once, by process 0.
        if jax.process_count() > 1 and jax.process_index() != 0:
            return MeshDoesNotFitError.exit_code
        raise
    if args.print_config:
        print(config)
        return 0
    # Only process 0 speaks for the run; the others print only their own failures.
    speaks = jax.process_index() == 0
    if speaks:
        group = getattr(args, "process_group", None) or distributed.ProcessGroup("none")
        print(
            f"{distributed.describe(group)}; {jax.device_count()} devices "
            f"({jax.local_device_count()} per process)",
            flush=True,
        )
    summary = trainer.run()
    if summary["preempted"]:
        by = summary.get("stopped_by") or "SIGTERM"
        shown = "Ctrl-C" if by == "SIGINT" else by
        # Every process: each says that it saved and why it exits (143 or 130).
        print(
            f"jaxdist train: stopped by {shown} at step {summary['step']}; checkpoint saved; "
            "rerun the same command to resume"
        )
        return INTERRUPTED_EXIT_CODE if by == "SIGINT" else PREEMPTED_EXIT_CODE
    if not speaks:
        return 0
    skip = ("step", "epoch", "preempted", "stopped_by", "already_finished")
    evals = ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k not in skip)
    done = "already finished" if summary.get("already_finished") else "done"
    print(
        f"{done}: step {summary['step']}, epoch {summary['epoch']:.2f}"
        + (f"; {evals}" if evals else "")
    )
    print(where_results_are(workdir, steps))
    return 0


def where_results_are(workdir: Path, profiled: tuple[int, int] | None = None) -> str:
    """The closing lines of a run: what its workdir holds and what to run next."""
    lines = [
        f"results in {workdir}/:",
        "  metrics.jsonl   train and eval metrics, one JSON record per line",
        "  events.log      MLPerf events (run_start ... run_stop; python -m "
        "mlperf_logging.compliance_checker --ruleset 4.0.0 checks them; pip install "
        "'jaxdist[mlperf]')",
        "  checkpoints/    the newest checkpoints; rerunning this command resumes from them",
    ]
    if profiled is not None:
        lines.append(
            f"  profile/        a trace of steps {profiled[0]} to {profiled[1]}: "
            f"tensorboard --logdir {workdir}/profile, or ui.perfetto.dev"
        )
    return "\n".join([*lines, f"curves: jaxdist plot {workdir}"])
