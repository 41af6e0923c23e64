"""``jaxdist pipeline profile|partition``: a recipe's per-layer costs, and the stage cut they
give (:mod:`jaxdist.pipeline.profile`, :mod:`jaxdist.pipeline.partition`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(actions: argparse._SubParsersAction) -> None:
    from jaxdist.cli.train import add_set_argument

    profile = actions.add_parser(
        "profile",
        help="measure a recipe's per-layer forward/backward time and sizes into a JSON file",
        description="Time every layer of RECIPE's model for one micro-batch on this machine's "
        "first device (the input pipeline excluded), or price it with the compiler of "
        "--topology's chip, and write the profile `jaxdist pipeline partition --profile` and "
        "pipeline.profile read.",
    )
    _common(profile, add_set_argument)
    profile.add_argument("--out", required=True, metavar="JSON", help="profile file to write")
    profile.add_argument("--repeats", type=int, default=11, help="timed rounds (median)")
    profile.set_defaults(func=profile_recipe, joins_process_group=False)

    cut = actions.add_parser(
        "partition",
        help="cut a recipe's layers into pipeline stages of equal time",
        description="Choose the boundaries that minimise the slowest stage's time (compute "
        "plus sending its activations) for STAGES stages, from a profile (--profile FILE), "
        "the compiler of a chip that is not here (--topology), or one measured now; print "
        "each stage's predicted time and memory and the bubble, beside the even cut.",
    )
    _common(cut, add_set_argument)
    cut.add_argument("--stages", type=int, required=True, help="pipeline stages")
    cut.add_argument("--profile", metavar="JSON", help="a profile from `pipeline profile`")
    cut.add_argument("--link", metavar="LAT:BW", help="link between stages, e.g. 5us:45GB/s")
    cut.add_argument("--memory-limit", type=float, metavar="GIB", help="bytes per device")
    cut.add_argument("--microbatches", type=int, help="default: the recipe's")
    cut.add_argument(
        "--schedule", help="gpipe, 1f1b, pipedream or pipedream_2bw (default: the recipe's)"
    )
    cut.set_defaults(func=partition_recipe, joins_process_group=False)


def _common(p: argparse.ArgumentParser, add_set_argument) -> None:
    p.add_argument("recipe", help="recipe file or name, e.g. recipes/resnet152_imagenet_gpipe.py")
    add_set_argument(p, "model.width=16")
    p.add_argument(
        "--micro-batch",
        type=int,
        metavar="N",
        help="images per micro-batch (default: the recipe's)",
    )
    p.add_argument(
        "--topology",
        metavar="T",
        help="price layers for this chip's compiler "
        "(a slice name such as v5e:2x2 or h100:1x8; one chip of it) instead of timing them here",
    )


class PartitionArgumentError(ValueError):
    exit_code = 2


def _subject(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, dict]:
    """``(config, model, example, optimizer, description)`` of the recipe: its model with
    BatchNorm local to one device, one micro-batch's input shape, its optimizer."""
    import jax
    import jax.numpy as jnp

    from jaxdist import meshes
    from jaxdist.aot.stand_in import stand_in_data
    from jaxdist.data import DataConfig, make_pipeline
    from jaxdist.run import config as config_lib
    from jaxdist.run.from_config import build_optimizer
    from jaxdist.tasks.image_classification import build_model, model_description

    path = config_lib.resolve_recipe_path(args.recipe)
    config = config_lib.apply_overrides(config_lib.load_recipe(path), args.overrides)
    data = make_pipeline(DataConfig.from_dict(stand_in_data(config)[0].data.to_dict()))
    model_cfg = config.model.copy_and_resolve_references()
    model_cfg.bn_group_size = None  # one device: statistics of its own micro-batch
    model = build_model(model_cfg, data.num_classes, None, 1)
    if not hasattr(model, "num_layers"):
        raise PartitionArgumentError(
            f"model {config.model.name!r} does not run spans of its layers, so it cannot be cut"
        )
    micro = args.micro_batch
    if micro is None:
        stages = getattr(args, "stages", None) or max(config.pipeline.stages, 1)
        devices = meshes.load(config.mesh).size if config.mesh else jax.device_count()
        replicas = max(devices // stages, 1)
        micro = config.batch_size // (replicas * max(config.pipeline.microbatches, 1))
    if micro < 1:
        raise PartitionArgumentError(f"--micro-batch must be at least 1, got {micro}")
    example = jax.ShapeDtypeStruct((micro, *data.image_shape), jnp.float32)
    optimizer = build_optimizer(config.optimizer, config.lr.peak)
    return config, model, example, optimizer, model_description(config)


def _profile(args: argparse.Namespace, subject, progress) -> Any:
    import jax.numpy as jnp

    from jaxdist.pipeline.profile import measure_profile

    _, model, example, optimizer, description = subject
    if args.topology:
        from jaxdist.aot.layer_profile import compiler_profile
        from jaxdist.aot.topology import parse_topology

        return compiler_profile(
            model,
            example,
            optimizer,
            parse_topology(args.topology),
            description=description,
            progress=progress,
        )
    return measure_profile(
        model,
        jnp.zeros(example.shape, example.dtype),
        optimizer,
        description=description,
        repeats=getattr(args, "repeats", 11),
        progress=progress,
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def profile_recipe(args: argparse.Namespace) -> int:
    subject = _subject(args)
    profile = _profile(args, subject, _progress)
    profile.write(args.out)
    total = sum(x.forward_s + x.backward_s for x in profile.layers)
    print(
        f"wrote {args.out}: {len(profile.layers)} layers, micro-batch {profile.micro_batch}, "
        f"{total * 1e3:.2f} ms forward and backward in all ({profile.source}, "
        f"{profile.device})"
    )
    return 0


def partition_recipe(args: argparse.Namespace) -> int:
    from jaxdist.comm.cost_model import Link, parse_link
    from jaxdist.pipeline import schedules
    from jaxdist.pipeline.partition import partition, stage_costs
    from jaxdist.pipeline.profile import layer_sizes, read_profile

    if args.profile and args.topology:
        raise PartitionArgumentError("give --profile or --topology, not both")
    subject = _subject(args)
    config, model, example, _, description = subject
    if args.profile:
        profile = read_profile(args.profile)
        profile.check_matches(description, example.shape[0], layer_sizes(model, example))
    else:
        profile = _profile(args, subject, _progress)
    try:
        link = parse_link(args.link) if args.link else Link(0.0, 0.0)
    except ValueError as err:
        raise PartitionArgumentError(f"--link: {err}") from None
    schedule = args.schedule or config.pipeline.schedule
    if schedule == "interleaved":
        raise PartitionArgumentError(
            "the partitioner cuts one model chunk per device (gpipe, 1f1b, pipedream, "
            "pipedream_2bw); the interleaved schedule's chunks are cut evenly or at boundaries"
        )
    microbatches = args.microbatches or max(config.pipeline.microbatches, 1)
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    cut = partition(
        profile,
        args.stages,
        link,
        schedule=schedule,
        microbatches=microbatches,
        memory_limit_bytes=limit,
    )
    priced = (
        f"link {link.alpha * 1e6:g} us + {link.beta * 1e9:g} ns/B"
        if args.link
        else "sends not priced (no --link)"
    )
    print(
        f"{len(profile.layers)} layers of {description['name']} (micro-batch "
        f"{profile.micro_batch}, {profile.source} on {profile.device}) into {args.stages} "
        f"stages, {schedule} with {microbatches} micro-batches; {priced}"
    )
    print(
        f"boundaries: {list(cut.boundaries)}   (recipe: --set pipeline.boundaries="
        f'"{tuple(cut.boundaries)}")'
    )
    _print_stages(cut.stages)
    print(
        f"slowest stage {cut.slowest_s * 1e3:.3f} ms per micro-batch; step "
        f"{cut.step_seconds() * 1e3:.2f} ms, bubble {cut.bubble():.3f}"
    )
    if args.stages <= len(profile.layers) and len(profile.layers) % args.stages == 0:
        even = tuple(range(0, len(profile.layers), len(profile.layers) // args.stages))
        live = schedules.build(schedule, args.stages, microbatches).live_activations()
        slowest = max(c.time_s for c in stage_costs(profile, even, link, live))
        print(
            f"even cut {list(even)}: slowest stage {slowest * 1e3:.3f} ms "
            f"({slowest / cut.slowest_s:.2f}x the partitioner's)"
        )
    return 0


def _print_stages(stages) -> None:
    print(
        f"{'stage':>5} {'layers':>9} {'forward ms':>11} {'backward ms':>12} {'send ms':>9} "
        f"{'total ms':>9} {'memory':>11}"
    )
    for s, c in enumerate(stages):
        print(
            f"{s:>5} {f'{c.start}-{c.stop - 1}':>9} {c.forward_s * 1e3:>11.3f} "
            f"{c.backward_s * 1e3:>12.3f} {c.send_s * 1e3:>9.3f} {c.time_s * 1e3:>9.3f} "
            f"{_size(c.memory_bytes):>11}"
        )


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
