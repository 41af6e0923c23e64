"""Calibrate the plan's time model on one published ResNet-50 run and predict the others.

    python benchmarks/plan_validation.py [--topology v5e:2x2] [--per-chip-batch 32]

1. Compiles the ResNet-50 recipe's train step for a small TPU slice (the TPU compiler, no
   TPU) and reads ResNet-50's facts from it: FLOPs per image, gradient bytes, and the share
   of backward the compiler placed after the first gradient bucket.
2. Finds the efficiency (share of peak FLOP/s) at which the time model gives the calibration
   run's published time, and writes it to ``jaxdist/aot/calibration.json`` (what
   ``jaxdist plan`` uses).
3. Predicts every other published run with it and prints the table of docs/planning.md;
   ``benchmarks/results/plan_validation.json`` keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

RESULTS = Path(__file__).parent / "results" / "plan_validation.json"


def model_facts(topology_name: str, per_chip_batch: int):
    from jaxdist.aot.plan import plan_recipe
    from jaxdist.aot.published import ModelFacts
    from jaxdist.aot.topology import parse_topology
    from jaxdist.run import config as config_lib

    topology = parse_topology(topology_name)
    config = config_lib.load_recipe(config_lib.resolve_recipe_path("resnet50_imagenet_mlperf_lars"))
    config = config_lib.apply_overrides(config, [
        f"batch_size={per_chip_batch * topology.num_chips}",
        f"max_per_device_batch={per_chip_batch}",
        "model.bn_group_size=None",
    ])  # fmt: skip
    plan = plan_recipe(config, topology, efficiency=1.0)
    compiled = plan.stages[0].compiled
    facts = ModelFacts(
        flops_per_image=compiled.flops / per_chip_batch,
        gradient_bytes=compiled.gradient_bytes,
        overlapped_backward_fraction=compiled.schedule.overlapped_backward_fraction,
        measured_on=f"ResNet-50 (bf16) train step, {per_chip_batch} images per chip, "
        f"compiled for {topology_name} in {compiled.compile_seconds:.0f} s",
    )
    return facts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--per-chip-batch", type=int, default=32)
    parser.add_argument(
        "--reuse-facts",
        action="store_true",
        help="take ResNet-50's facts from the calibration file instead of compiling again",
    )
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    from jaxdist.aot import published

    if args.reuse_facts:
        stored = json.loads(published.CALIBRATION_FILE.read_text())["facts"]
        facts = published.ModelFacts(**stored)
    else:
        facts = model_facts(args.topology, args.per_chip_batch)
    print(f"ResNet-50 facts: {facts}", file=sys.stderr)
    runs = {run.name: run for run in published.PUBLISHED_RUNS}
    calibration_run = runs[published.CALIBRATION_RUN]
    efficiency = published.calibrate(calibration_run, facts)
    published.write_calibration(calibration_run, facts, efficiency)
    rows = [_row(run, published.predict_run(run, facts, efficiency)) for run in runs.values()]
    RESULTS.write_text(
        json.dumps({"efficiency": efficiency, "facts": facts.__dict__, "runs": rows}, indent=2)
        + "\n"
    )
    print(f"efficiency {efficiency:.3f} of peak, calibrated on {calibration_run.name}")
    print(TABLE_HEAD)
    for r in rows:
        error = "(calibration)" if r["run"] == calibration_run.name else f"{r['error']:+.0%}"
        batches = " → ".join(f"{b:,}" for b in r["global_batches"])
        print(f"| {r['run']} | {r['chips']:,} × {r['chip']} | {batches} | {r['epochs']:g} "
              f"| {r['published_seconds']:,.0f} s | {r['predicted_seconds']:,.0f} s | {error} "
              f"| {r['published_images_per_second_per_chip']:,.0f} "
              f"| {r['predicted_images_per_second_per_chip']:,.0f} "
              f"| {r['exposed_communication_share']:.0%} |")  # fmt: skip
    print(f"wrote {RESULTS} and {published.CALIBRATION_FILE}", file=sys.stderr)
    return 0


TABLE_HEAD = (
    "| run | chips | global batch | epochs | published | predicted | error "
    "| published images/s per chip | predicted | exposed communication |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _row(run, predicted: dict) -> dict:
    published_rate = run.epochs * 1_281_167 / run.seconds / run.chips
    return {
        "run": run.name,
        "chip": run.chip,
        "chips": run.chips,
        "global_batches": [batch for _, batch in run.batches],
        "epochs": run.epochs,
        "published_seconds": run.seconds,
        "predicted_seconds": predicted["seconds"],
        "error": predicted["seconds"] / run.seconds - 1,
        "published_images_per_second_per_chip": published_rate,
        "predicted_images_per_second_per_chip": predicted["images_per_second_per_chip"],
        "exposed_communication_share": predicted["exposed_communication_share"],
        "predicted_stages": predicted["stages"],
        "source": run.source,
    }


if __name__ == "__main__":
    sys.exit(main())
