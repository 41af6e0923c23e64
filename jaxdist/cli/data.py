"""``jaxdist data convert|inspect|bench|fake``: prepare, check and time the input pipeline."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from jaxdist.data.config import SOURCES

# The command line is the interface; nothing here is for import.
__all__: list[str] = []


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="prepare, inspect and benchmark datasets")
    # Single-process tools: never join a multi-process JAX run.
    data.set_defaults(joins_process_group=False)
    actions = data.add_subparsers(dest="data_action", metavar="ACTION")

    convert = actions.add_parser(
        "convert", help="pack a ROOT/{train,val}/<class>/*.JPEG folder into ArrayRecord shards"
    )
    convert.add_argument("--src", required=True, metavar="ROOT", help="folder dataset root")
    convert.add_argument("--dst", required=True, metavar="OUT", help="output folder")
    convert.add_argument("--shards", type=int, required=True, metavar="N", help="train shards")
    convert.add_argument(
        "--val-shards",
        type=int,
        default=None,
        metavar="M",
        help="shards for val (default: in proportion to its size)",
    )
    convert.add_argument(
        "--verify",
        action="store_true",
        help="fully decode every image so corrupt files fail now, not in training",
    )
    convert.set_defaults(func=convert_dataset)

    inspect = actions.add_parser(
        "inspect",
        help="print images per split and class of a folder, ArrayRecord, TFDS or HF dataset",
    )
    inspect.add_argument(
        "path",
        metavar="PATH",
        help="folder root, converted ArrayRecord folder, tfds:NAME or hf:NAME (a Hub name or "
        "local folder; inspecting it also prepares the datasets cache once)",
    )
    inspect.add_argument(
        "--root",
        default=None,
        metavar="DIR",
        help="the TFDS data dir (tfds:) or the datasets cache dir (hf:); default: the library's",
    )
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="decode every image and name each one that cannot be decoded (exit 1 if any)",
    )
    inspect.add_argument(
        "--train-split",
        default="train",
        metavar="SPLIT",
        help="what training reads, as data.train_split says it (default train; e.g. "
        "'train[:90%%]')",
    )
    inspect.add_argument(
        "--eval-split",
        default="val",
        metavar="SPLIT",
        help="what evaluation reads, as data.eval_split says it (default val, the dataset's "
        "held-out split; e.g. test, 'train[90%%:]')",
    )
    inspect.set_defaults(func=inspect_dataset)

    _add_bench_and_fake(actions)


def _add_bench_and_fake(actions: argparse._SubParsersAction) -> None:
    bench = actions.add_parser("bench", help="images/s of the training input pipeline")
    bench.add_argument(
        "--source",
        default="synthetic",
        choices=SOURCES,
    )
    bench.add_argument(
        "--root", default=None, help="dataset folder; for tfds / hf the data or cache dir"
    )
    bench.add_argument("--dataset", default=None, help="tfds / hf dataset name")
    bench.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    bench.add_argument("--steps", type=int, default=20, help="timed batches (default 20)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed batches first (default 2)")
    bench.add_argument("--image-size", type=int, default=224)
    bench.add_argument("--dtype", default="float32", choices=("float32", "uint8"))
    bench.add_argument(
        "--loader",
        default="grain",
        help="loaders to time, comma-separated: grain, dali (default grain)",
    )
    bench.add_argument(
        "--workers",
        default="0",
        help="grain worker processes, comma-separated counts to time each (default 0)",
    )
    bench.add_argument("--threads", type=int, default=2, help="read threads per process/worker")
    bench.add_argument(
        "--dali-threads", type=int, default=0, help="DALI threads per pipeline (0: all cores)"
    )
    bench.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="a `jaxdist plan --json` output: say how many of a host's accelerators each "
        "rate feeds at the step time it predicts",
    )
    bench.set_defaults(func=bench_pipeline)

    fake = actions.add_parser("fake", help="write a small ImageNet-format folder of JPEGs")
    fake.add_argument("dst", metavar="ROOT")
    fake.add_argument("--classes", type=int, default=10)
    fake.add_argument("--train-per-class", type=int, default=20)
    fake.add_argument("--val-per-class", type=int, default=5)
    fake.add_argument("--min-size", type=int, default=200)
    fake.add_argument("--max-size", type=int, default=500)
    fake.add_argument("--seed", type=int, default=0)
    fake.add_argument(
        "--style",
        default="smooth",
        choices=("smooth", "photo"),
        help="smooth colour fields (small files) or photo-like images that decode as slowly as "
        "ImageNet's photographs (default smooth)",
    )
    fake.set_defaults(func=fake_dataset)


def _fail(err: Exception) -> int:
    print(f"jaxdist data: {err}", file=sys.stderr)
    return 2


def convert_dataset(args: argparse.Namespace) -> int:
    from jaxdist.data.arrayrecord import convert_folder
    from jaxdist.data.sources import DatasetError

    started = []

    def progress(split: str, done: int, total: int, seconds: float) -> None:
        if not started:  # said once the output is known to be writable, not before
            started.append(True)
            print(f"converting {args.src} -> {args.dst} ({args.shards} train shards)")
        rate = done / seconds if seconds > 0 else 0.0
        end = "\n" if done == total else "\r"
        print(
            f"  {split}: {done:,}/{total:,} images ({100 * done / total:5.1f}%), {rate:,.0f}/s",
            end=end,
            flush=True,
        )

    try:
        meta = convert_folder(
            args.src, args.dst, args.shards, args.val_shards, progress=progress, verify=args.verify
        )
    except (DatasetError, ValueError, OSError) as err:
        return _fail(err)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['num_records']:,} records in {len(info['shards'])} shard(s)")
    print(f"wrote {Path(args.dst) / 'metadata.json'} ({len(meta['classes'])} classes)")
    return 0


def inspect_dataset(args: argparse.Namespace) -> int:
    """Counts per split and class; exits as ``jaxdist train`` would on the dataset (1, in one
    line, where training would refuse it: missing, malformed, no usable held-out split)."""
    from jaxdist.data.sources import DatasetError

    try:
        kind, splits, refusal = _open_splits(args)
    except DatasetError as err:
        print(f"jaxdist data: {err}", file=sys.stderr)
        return err.exit_code
    print(f"{args.path} ({kind})")
    bad: list[str] = []
    for split, (source, counts) in splits.items():
        total = sum(counts.values())
        print(f"  {split}: {total:,} images, {len(counts)} of {len(source.classes)} classes")
        for label, name in enumerate(source.classes):
            print(f"    {name:<24s} {counts.get(label, 0):>8,d}")
        if args.verify:
            bad += undecodable_images(source, split)
    if refusal is not None:
        print(f"jaxdist data: training would refuse this dataset: {refusal}", file=sys.stderr)
        return refusal.exit_code
    if not args.verify:
        return 0
    checked = sum(sum(counts.values()) for _, counts in splits.values())
    if not bad:
        print(f"verified: all {checked:,} images decode")
        return 0
    for line in bad:
        print(f"  {line}", file=sys.stderr)
    print(f"{len(bad)} of {checked:,} images cannot be decoded (listed above)", file=sys.stderr)
    return 1


def _open_splits(
    args: argparse.Namespace,
) -> tuple[str, dict[str, tuple[Any, Counter]], Exception | None]:
    """``(kind, {split: (source, images per label)}, why the held-out split cannot be used or
    None)`` of the dataset ``args.path`` names, opened as training opens it (the same split
    strings, class checks and overlap check); a train split that cannot be read is an error."""
    from jaxdist.data.arrayrecord import METADATA
    from jaxdist.data.config import DataConfig, Pipeline
    from jaxdist.data.sources import DatasetError

    path = args.path
    kind, _, name = path.partition(":") if path.startswith(("tfds:", "hf:")) else ("", "", path)
    if not kind:
        kind = "arrayrecord" if (Path(path) / METADATA).exists() else "folder"
    where = {"dataset": name, "root": args.root} if kind in ("tfds", "hf") else {"root": path}
    try:
        config = DataConfig(
            source=kind, train_split=args.train_split, eval_split=args.eval_split, **where
        )
    except ValueError as err:
        raise DatasetError(str(err)) from err
    pipeline = Pipeline(config, show_progress=True)
    splits = {args.train_split: (pipeline.train_source, Counter(labels_of(pipeline.train_source)))}
    try:
        held_out = pipeline.eval_source
    except DatasetError as err:
        return kind, splits, err
    splits[args.eval_split] = (held_out, Counter(labels_of(held_out)))
    return kind, splits, None


def labels_of(source: Any) -> list[int]:
    """Every record's label, from a label list where the source has one (no image is read)."""
    from jaxdist.data.splits import SplitSource

    if isinstance(source, SplitSource):
        labels = []
        for piece, records in source.pieces:
            whole = labels_of(piece)
            labels += [whole[i] for i in records]
        return labels
    labels = getattr(source, "labels", None)
    if labels is not None:
        return (labels() if callable(labels) else labels).tolist()
    return [source[i]["label"] for i in range(len(source))]


def undecodable_images(source, split: str) -> list[str]:
    """``"NAME: reason"`` for every image of ``source`` that cannot be decoded, or whose
    stored bytes fail their checksum (TFRecord files keep one per record)."""
    from jaxdist.data.sources import DatasetError
    from jaxdist.data.splits import SplitSource
    from jaxdist.data.transforms import decode

    bad = []
    for index in range(len(source)):
        record = source[index]
        name = record.get("name", f"{split} record {index}")
        origin, inner = source.locate(index) if isinstance(source, SplitSource) else (source, index)
        verify = getattr(origin, "verify_record", None)
        if verify is not None and not verify(inner):
            bad.append(f"{name}: its bytes do not match their checksum (changed after writing)")
            continue
        try:
            decode(record["jpeg"], name)
        except DatasetError:
            reason = "empty file" if not record["jpeg"] else "not a JPEG or other image"
            bad.append(f"{name}: {reason}")
    return bad


def bench_pipeline(args: argparse.Namespace) -> int:
    from jaxdist.aot.input_demand import demand_of_plan
    from jaxdist.bench.data import measure
    from jaxdist.data.config import LOADERS, DataConfig
    from jaxdist.data.sources import DatasetError

    try:
        loaders = [name.strip() for name in args.loader.split(",")]
        unknown = [name for name in loaders if name not in LOADERS]
        if unknown:
            raise ValueError(f"--loader takes {', '.join(LOADERS)}, got {', '.join(unknown)}")
        workers = _counts(args.workers, "--workers")
        demand = demand_of_plan(args.plan) if args.plan else None
    except ValueError as err:
        return _fail(err)
    print(
        f"data bench: source={args.source} batch={args.batch} image={args.image_size} "
        f"dtype={args.dtype} threads={args.threads}"
    )
    if demand is not None:
        print(
            f"  the plan: {demand.per_chip_batch} images per {demand.chip} chip every "
            f"{demand.step_seconds * 1e3:.1f} ms = {demand.images_per_s_per_chip:,.0f} images/s "
            f"per chip, {demand.chips_per_host} chips per host"
        )
    runs = [(name, count) for name in loaders for count in (workers if name == "grain" else [0])]
    for loader, count in runs:
        try:
            config = DataConfig(
                source=args.source,
                root=args.root,
                dataset=args.dataset,
                image_size=args.image_size,
                dtype=args.dtype,
                loader=loader,
                dali_threads=args.dali_threads,
                worker_count=count,
                read_threads=args.threads,
            )
            rate = measure(config, args.batch, args.steps, args.warmup)
        except (DatasetError, ValueError) as err:
            return _fail(err)
        if loader == "dali":
            label = f"dali (threads {args.dali_threads or 'all'})"
        else:
            label = f"grain (workers {count})"
        line = (
            f"  {label:<22} {rate.images_per_s:>9,.0f} images/s over {rate.batches} batches "
            f"({rate.seconds:.2f} s); first batch after {rate.first_batch_s:.2f} s"
        )
        if demand is not None:
            fed = demand.chips_fed(rate.images_per_s)
            line += f"; feeds {fed:.1f} of this host's {demand.chips_per_host} accelerators"
        print(line, flush=True)
    return 0


def _counts(text: str, flag: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise ValueError(f"{flag} takes comma-separated counts >= 0 such as 0,2,4, got {text!r}")
    return counts


def fake_dataset(args: argparse.Namespace) -> int:
    from jaxdist.data.fake import write_image_folder

    root = write_image_folder(
        args.dst,
        args.classes,
        args.train_per_class,
        args.val_per_class,
        (args.min_size, args.max_size),
        args.seed,
        args.style,
    )
    print(
        f"wrote {root}: {args.classes} classes x ({args.train_per_class} train + "
        f"{args.val_per_class} val) {args.style} JPEGs of {args.min_size}-{args.max_size} px"
    )
    return 0
