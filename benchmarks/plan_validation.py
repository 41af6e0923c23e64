"""The plan's time models set against published ResNet-50 training: the MLPerf record, and the
runs the step-time model is calibrated on.

    python benchmarks/plan_validation.py [--root ../shared/mlperf]
    python benchmarks/plan_validation.py --predict ROOT
    python benchmarks/plan_validation.py --published [--topology v5e:2x2] [--per-chip-batch 32]

Default: the record. Reads every result log under ``--root`` (``benchmarks/mlperf_record.py``),
fits the record's time model (:class:`jaxdist.aot.record.RecordFit`: per accelerator
generation, from what a planner knows before the run: chips, global batch and MLPerf's
reference epochs at it) on every scored closed-division submission, keeps it in
``jaxdist/aot/data/mlperf_record_fit.json`` (what ``jaxdist plan`` prints), and scores it:
each submission predicted by the model fitted on all the others (leave-one-out), by
generation and by scale, the error split into convergence (the submission's own epochs
against the reference) and throughput, the worst cases named; then fitted on the rounds up
to v2.1 only and predicting v3.0 and v3.1. ``benchmarks/results/plan_validation_record.json``
keeps the figures.

``--predict ROOT``: each scored submission under ROOT (laid out as ``--root``) predicted by
the stored fit, nothing refitted.

``--published``: the step-time model. Compiles the ResNet-50 recipe's train step for a small
TPU slice (the TPU compiler, no TPU) and reads ResNet-50's facts from it: FLOPs per image, the
gradient buckets' bytes, and the share of the gradients' communication time the wait-free
step hides behind compute (the compiled order walked, jaxdist.aot.timeline). Finds the
efficiency (share of peak FLOP/s) at which the model gives the calibration run's published
time, writes it to ``jaxdist/aot/calibration.json`` (what ``jaxdist plan`` uses for a step),
predicts every other published run with it, and scores the model on the 11 MLPerf runs
leave-one-out and over time. ``benchmarks/results/plan_validation.json`` keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
import record_validation

RESULTS = Path(__file__).parent / "results" / "plan_validation.json"
RECORD_RESULTS = Path(__file__).parent / "results" / "plan_validation_record.json"
RECORD_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "mlperf"
# The temporal split: fitted on these rounds, predicting the later ones.
EARLY_RECORD_ROUNDS = ("v0.7", "v1.0", "v1.1", "v2.0", "v2.1")


def model_facts(topology_name: str, per_chip_batch: int):
    from jaxdist.aot.plan import plan_recipe
    from jaxdist.aot.published import ModelFacts
    from jaxdist.aot.topology import parse_topology
    from jaxdist.run import config as config_lib

    topology = parse_topology(topology_name)
    config = config_lib.load_recipe(config_lib.resolve_recipe_path("resnet50_imagenet_mlperf_lars"))
    config = config_lib.apply_overrides(
        config,
        [
            f"batch_size={per_chip_batch * topology.num_chips}",
            f"max_per_device_batch={per_chip_batch}",
            "model.bn_group_size=None",
            "wait_free=True",
        ],
    )
    plan = plan_recipe(config, topology, efficiency=1.0)
    compiled = plan.stages[0].compiled
    facts = ModelFacts(
        flops_per_image=compiled.flops / per_chip_batch,
        gradient_bytes=compiled.gradient_bytes,
        bucket_bytes=tuple(compiled.bucket_bytes),
        gradient_hidden_fraction=plan.stages[0].step_time.hidden_fraction,
        measured_on=f"ResNet-50 (bf16) train step, {per_chip_batch} images per chip, "
        f"compiled for {topology_name} in {compiled.compile_seconds:.0f} s",
    )
    return facts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=RECORD_ROOT,
        help="the MLPerf record to fit on (default: %(default)s)",
    )
    parser.add_argument(
        "--predict",
        type=Path,
        metavar="ROOT",
        help="predict the scored submissions under ROOT with the stored fit",
    )
    parser.add_argument(
        "--published",
        action="store_true",
        help="calibrate the step-time model on the published runs instead",
    )
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--per-chip-batch", type=int, default=32)
    parser.add_argument(
        "--reuse-facts",
        action="store_true",
        help="take ResNet-50's facts from the calibration file instead of compiling again",
    )
    args = parser.parse_args(argv)
    if args.predict is not None:
        return record_validation.predict(args.predict)
    if not (args.published or args.reuse_facts):  # --reuse-facts is the published runs' flag
        return record_validation.validate(args.root, RECORD_RESULTS, EARLY_RECORD_ROUNDS)
    jax.config.update("jax_platforms", "cpu")
    from jaxdist.aot import published

    if args.reuse_facts:
        stored = json.loads(published.CALIBRATION_FILE.read_text())["facts"]
        fields = set(published.ModelFacts.__dataclass_fields__)
        if set(stored) != fields:
            print(
                f"--reuse-facts: {published.CALIBRATION_FILE} holds facts "
                f"{sorted(stored)}, this version needs {sorted(fields)}: run without "
                "--reuse-facts to compile them",
                file=sys.stderr,
            )
            return 2
        facts = published.ModelFacts(**{**stored, "bucket_bytes": tuple(stored["bucket_bytes"])})
    else:
        facts = model_facts(args.topology, args.per_chip_batch)
    print(f"ResNet-50 facts: {facts}", file=sys.stderr)
    runs = {run.name: run for run in published.PUBLISHED_RUNS}
    calibration_run = runs[published.CALIBRATION_RUN]
    efficiency = published.calibrate(calibration_run, facts)
    by_generation = published.fit_by_generation(facts)
    published.write_calibration(calibration_run, facts, efficiency, by_generation)
    rows = [_row(run, published.predict_run(run, facts, efficiency)) for run in runs.values()]
    scores = _scores([runs[name] for name in published.MLPERF_RUNS], facts)
    RESULTS.write_text(
        json.dumps(
            {
                "efficiency": efficiency,
                "facts": asdict(facts),
                "runs": rows,
                "by_generation": by_generation,
                **scores,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"efficiency {efficiency:.3f} of peak, calibrated on {calibration_run.name}")
    print(TABLE_HEAD)
    for r in rows:
        error = "(calibration)" if r["run"] == calibration_run.name else f"{r['error']:+.0%}"
        batches = " → ".join(f"{b:,}" for b in r["global_batches"])
        print(
            f"| {r['run']} | {r['chips']:,} × {r['chip']} | {batches} | {r['epochs']:g} "
            f"| {r['published_seconds']:,.0f} s | {r['predicted_seconds']:,.0f} s | {error} "
            f"| {r['published_images_per_second_per_chip']:,.0f} "
            f"| {r['predicted_images_per_second_per_chip']:,.0f} "
            f"| {r['exposed_communication_share']:.0%} |"
        )
    print("\nefficiency per generation, fitted on its MLPerf runs (what a plan uses):")
    for chip, fit in by_generation.items():
        print(f"  {chip}: {fit['efficiency']:.3f} (fitted on {len(fit['runs'])} of its runs)")
    _print_scores(**scores)
    print(f"wrote {RESULTS} and {published.CALIBRATION_FILE}", file=sys.stderr)
    return 0


def _scores(scored: list, facts) -> dict:
    """Leave-one-out (per generation, and one efficiency for all) and the temporal split."""
    from jaxdist.aot import published

    early = [r for r in scored if r.name.startswith(published.EARLY_ROUNDS)]
    temporal_efficiency = published.fit_efficiency(early, facts)
    temporal = []
    for r in (r for r in scored if r not in early):
        row = {"run": r.name, "error": _error(r, facts, temporal_efficiency)}
        same = [e for e in early if e.chip == r.chip]
        row["own_generation_error"] = (
            _error(r, facts, published.fit_efficiency(same, facts)) if same else None
        )
        temporal.append(row)
    return {
        "leave_one_out_by_generation": published.leave_one_out_by_generation(facts),
        "leave_one_out": published.leave_one_out(scored, facts),
        "temporal_split": {
            "efficiency": temporal_efficiency,
            "runs": temporal,
            "fitted_on": [r.name for r in early],
        },
    }


def _print_scores(leave_one_out_by_generation, leave_one_out, temporal_split) -> None:
    own_rows, one_rows = leave_one_out_by_generation, leave_one_out
    scored_rows = [r for r in own_rows if r["error"] is not None]
    within = sum(abs(r["error"]) <= 0.2 for r in scored_rows)
    print(
        f"\nleave-one-out, each MLPerf run predicted with its generation's efficiency fitted on "
        f"that generation's other runs: {within} of {len(own_rows)} within ±20% "
        f"({len(own_rows) - len(scored_rows)} without another run of their "
        "generation, unscored); beside it, one efficiency for every chip fitted on the other "
        "ten:"
    )
    print(
        "| run | own generation: efficiency | error | one efficiency: efficiency | error |\n"
        "|---|---|---|---|---|"
    )
    for own, one in zip(own_rows, one_rows, strict=True):
        mine = (
            f"{own['efficiency']:.3f} | {own['error']:+.0%}"
            if own["error"] is not None
            else f"— | unscored: {own['why']}"
        )
        print(f"| {own['run']} | {mine} | {one['efficiency']:.3f} | {one['error']:+.0%} |")
    within = sum(abs(r["error"]) <= 0.2 for r in one_rows)
    print(f"one efficiency for every chip: {within} of {len(one_rows)} within ±20%")
    fitted_on = len(temporal_split["fitted_on"])
    print(f"\ntemporal split: fitted on v0.6-v1.0 ({fitted_on} runs), predicting v2.0-v4.0")
    print(
        "| run | own generation's earlier runs | one efficiency "
        f"({temporal_split['efficiency']:.3f}) |\n|---|---|---|"
    )
    for r in temporal_split["runs"]:
        own = r["own_generation_error"]
        own = f"{own:+.0%}" if own is not None else "— (no earlier run of its generation)"
        print(f"| {r['run']} | {own} | {r['error']:+.0%} |")


TABLE_HEAD = (
    "| run | chips | global batch | epochs | published | predicted | error "
    "| published images/s per chip | predicted | exposed communication |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _error(run, facts, efficiency: float) -> float:
    from jaxdist.aot import published

    return published.predict_run(run, facts, efficiency)["seconds"] / run.seconds - 1


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
