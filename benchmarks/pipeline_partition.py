"""Stage times the partitioner predicts against measured ones: ResNet-50 cut two ways.

    python benchmarks/pipeline_partition.py [--stages 4,8] [--width 16] [--image 64]
        [--micro-batch 8] [--repeats 21]

ResNet-50's 18 layers (the stem, 16 bottleneck blocks, the classifier) are profiled one by one
on this machine (:func:`jaxdist.pipeline.profile.measure_profile`) and cut into S stages
twice: by the partitioner, and evenly by layer count (counts as equal as they go, the first
stages taking one more). Every stage of both cuts is then compiled as one span, its forward
and the pipeline's backward op (the forward recomputed and pulled back), and timed in the
same interleaved rounds as the layers (:func:`jaxdist.pipeline.profile.interleaved_seconds`),
so that the prediction, the sum of a stage's layers in the profile, and the measurement see
the machine alike.

Stages are timed alone, one after the other on one device. On a 2-core machine the 8 forced
CPU devices of a running pipeline share the cores, so a tick there shows the sum of every
stage's work, not the slowest stage's; alone, each stage's time is what it would take on a
device of its own. Rows go to ``benchmarks/results/pipeline_partition.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "pipeline_partition.json"


def even_cut(layers: int, stages: int) -> tuple[int, ...]:
    """First layers of ``stages`` stages of ``layers // stages`` layers, the first
    ``layers % stages`` of them one more."""
    size, extra = divmod(layers, stages)
    starts, at = [], 0
    for s in range(stages):
        starts.append(at)
        at += size + (s < extra)
    return tuple(starts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="4,8", help="stage counts to cut into")
    parser.add_argument("--width", type=int, default=16, help="first stage's filters")
    parser.add_argument("--image", type=int, default=64, help="image side")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=21, help="timed rounds")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"rows to this file ({RESULTS})")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist.comm.cost_model import Link
    from jaxdist.models import create
    from jaxdist.pipeline.partition import partition, stage_costs
    from jaxdist.pipeline.profile import interleaved_seconds, layer_calls, with_times

    model = create("resnet50", num_classes=1000, width=args.width)
    example = jnp.zeros((args.micro_batch, args.image, args.image, 3), jnp.float32)
    print(
        f"profiling ResNet-50 (width {args.width}, {args.image}x{args.image}, micro-batch "
        f"{args.micro_batch}) on {jax.devices()[0].device_kind}: the layers, then both cuts' "
        f"stages, timed in {args.repeats} interleaved rounds ...",
        file=sys.stderr,
        flush=True,
    )
    optimizer = optax.sgd(0.1, momentum=0.9)
    profile, calls = layer_calls(
        model, example, optimizer, description={"name": "resnet50", "width": args.width}
    )
    # The cuts come from a first profile; every stage is then timed in the same rounds as the
    # layers, so that prediction and measurement see the machine alike.
    first = with_times(profile, interleaved_seconds(calls, args.repeats))
    free = Link(0.0, 0.0)  # stages on one machine: a send is a copy in memory
    cuts = []
    for stages in (int(s) for s in args.stages.split(",")):
        cut = partition(first, stages, free, microbatches=stages)
        cuts += [
            (stages, "partitioner", cut.boundaries),
            (stages, "even", even_cut(len(profile.layers), stages)),
        ]
    # Each cut's stages, compiled as the spans a pipeline runs.
    spans = [
        layer_calls(model, example, optimizer, description={}, boundaries=b)[1] for _, _, b in cuts
    ]
    seconds = interleaved_seconds(calls + [c for span in spans for c in span], args.repeats)
    profile = with_times(profile, seconds[: len(calls)])
    measured = seconds[len(calls) :]
    rows = []
    for (stages, name, boundaries), span in zip(cuts, spans, strict=True):
        predicted = stage_costs(profile, boundaries, free, [0] * stages)
        times, measured = measured[: len(span)], measured[len(span) :]
        for s, p in enumerate(predicted):
            took = times[2 * s] + times[2 * s + 1]
            rows.append(
                {
                    "stages": stages,
                    "cut": name,
                    "boundaries": list(boundaries),
                    "stage": s,
                    "layers": [p.start, p.stop - 1],
                    "predicted_ms": p.time_s * 1e3,
                    "measured_ms": took * 1e3,
                    "error": (p.time_s - took) / took,
                }
            )
        mine = [r for r in rows if r["stages"] == stages and r["cut"] == name]
        print(
            f"S={stages} {name:<11} {list(boundaries)}: slowest measured "
            f"{max(r['measured_ms'] for r in mine):.2f} ms, predicted "
            f"{max(r['predicted_ms'] for r in mine):.2f} ms; worst stage error "
            f"{max(abs(r['error']) for r in mine):.1%}"
        )
    errors = [abs(r["error"]) for r in rows]
    print(
        f"stage predictions: median error {statistics.median(errors):.1%}, worst "
        f"{max(errors):.1%} over {len(rows)} stages"
    )
    record = {
        "model": "resnet50",
        "width": args.width,
        "image": args.image,
        "micro_batch": args.micro_batch,
        "device": jax.devices()[0].device_kind,
        "profile_ms": [(x.forward_s + x.backward_s) * 1e3 for x in profile.layers],
        "rows": rows,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
