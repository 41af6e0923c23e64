"""``jaxdist bench resnet``: ResNet-50 train-step images/s, jaxdist vs the flax example, with
the input pipeline's images/s beside them."""

from __future__ import annotations

import argparse
import json

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register_kind(kinds: argparse._SubParsersAction) -> None:
    """Add ``resnet`` to the ``bench`` kinds (called from :mod:`jaxdist.cli.bench`)."""
    p = kinds.add_parser(
        "resnet",
        help="ResNet-50 training images/s: jaxdist TrainStep vs the flax imagenet example",
        description="Time the ResNet-50 train step of jaxdist, of jaxdist with its 1x1 "
        "convolutions as nn.Conv (the model's share), and of the flax imagenet example "
        "(jit + pmean) on all devices at the same batch and resolution, in alternating rounds, "
        "and the input pipeline's images/s on this machine.",
    )
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--image-size", type=int, default=224, help="resolution (default 224)")
    p.add_argument("--width", type=int, default=64, help="ResNet width (default 64 = ResNet-50)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round (default 2)")
    p.add_argument(
        "--rounds", type=int, default=4, help="alternating timing rounds, medians (default 4)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compile")
    p.add_argument(
        "--no-conv-1x1-variant",
        dest="conv_1x1_variant",
        action="store_false",
        help="skip jaxdist's step with 1x1 convolutions as nn.Conv (the model's share)",
    )
    p.add_argument(
        "--pipeline-root",
        default=None,
        help="JPEG folder for the pipeline rate (default: a fake folder in a temp dir)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run_resnet)


def run_resnet(args: argparse.Namespace) -> int:
    import tempfile

    import jax

    from jaxdist.bench import data as data_bench
    from jaxdist.bench import resnet as resnet_bench
    from jaxdist.data import DataConfig
    from jaxdist.data.fake import write_image_folder

    rates = resnet_bench.measure(
        args.batch,
        args.image_size,
        args.steps,
        args.warmup,
        args.width,
        args.rounds,
        conv_1x1_variant=args.conv_1x1_variant,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = args.pipeline_root or write_image_folder(
            tmp, num_classes=4, train_per_class=64, size_range=(300, 500)
        )
        data_config = DataConfig(source="folder", root=str(root), image_size=args.image_size)
        pipeline = data_bench.measure(data_config, args.batch, steps=max(4, args.steps))
    print(
        f"# {jax.device_count()} {jax.devices()[0].platform} device(s), batch {args.batch}, "
        f"{args.image_size}x{args.image_size}, width {args.width}"
    )
    print(f"{'what':<30} {'images/s':>10} {'step ms':>10} {'compile s':>10}")
    for r in rates:
        print(f"{r.name:<30} {r.images_per_s:>10.1f} {r.step_ms:>10.1f} {r.compile_s:>10.1f}")
    print(f"{'input pipeline (JPEG)':<30} {pipeline.images_per_s:>10.1f}")
    by_name = {r.name: r.images_per_s for r in rates}
    flax_rate = by_name[resnet_bench.FLAX_EXAMPLE]
    for name in (resnet_bench.JAXDIST, resnet_bench.JAXDIST_CONV_1X1):
        if name in by_name:
            print(f"{name} / flax example: {by_name[name] / flax_rate:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "steps": [r.__dict__ for r in rates],
                    "pipeline_images_per_s": pipeline.images_per_s,
                    "batch": args.batch,
                    "image_size": args.image_size,
                    "devices": jax.device_count(),
                },
                f,
                indent=2,
            )
    return 0
