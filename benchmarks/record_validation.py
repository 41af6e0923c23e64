"""The record's time model scored on the MLPerf ResNet-50 record (run by plan_validation.py).

:func:`validate` fits :class:`jaxdist.aot.record.RecordFit` on every usable submission, keeps
it where ``jaxdist plan`` reads it, and prints the leave-one-out scores; :func:`predict`
predicts another record's submissions with the kept fit.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import mlperf_record

from jaxdist.aot import published, record
from jaxdist.aot.chips import CHIPS

WITHIN = 0.2  # the band a prediction counts as right in
# Scales the report is split by: (name, the largest host count it holds).
SCALES = (("one host", 1), ("2-64 hosts", 64), ("beyond 64 hosts", float("inf")))


def validate(root: Path, out: Path, early_rounds: Sequence[str]) -> int:
    """Fit on ``root``, keep the fit, print and write the scores."""
    if not root.is_dir():
        print(
            f"plan_validation: expected the MLPerf record at {root} (a folder of "
            "training_results_<round> repositories), found none: pass --root",
            file=sys.stderr,
        )
        return 2
    _, submissions, problems = mlperf_record.read_record([root])
    usable = record.fittable(submissions)
    source = (
        f"{len(usable)} scored closed-division MLPerf ResNet-50 submissions, "
        f"rounds {_rounds(usable)}"
    )
    fitted = record.fit(usable, source)
    record.FIT_FILE.write_text(json.dumps(fitted.to_json(), indent=1) + "\n")
    print(
        f"record: {len(submissions)} submissions ({len(problems)} logs skipped: "
        "benchmarks/mlperf_record.py says why); fitted on " + source
    )
    _print_left_out(submissions, usable)
    print(
        f"\nleave-one-out: each submission predicted by the model fitted on the other "
        f"{len(usable) - 1}"
    )
    held_out = leave_one_out(usable)
    rows = [_row(s, seconds) for s, seconds in zip(usable, held_out, strict=True)]
    print(summary(rows))
    _print_groups(rows, fitted)
    _print_worst(rows)
    early = [s for s in usable if s["round"] in early_rounds]
    late = [s for s in usable if s["round"] not in early_rounds]
    temporal = _temporal(early, late)
    print(
        f"\ntemporal split: fitted on {', '.join(early_rounds)} ({len(early)} submissions), "
        f"predicting the {len(late)} later ones: {temporal['summary']}"
    )
    out.write_text(
        json.dumps(
            {"fit": fitted.to_json(), "leave_one_out": rows, "temporal_split": temporal}, indent=1
        )
        + "\n"
    )
    print(f"wrote {out} and {record.FIT_FILE}", file=sys.stderr)
    return 0


def predict(root: Path) -> int:
    """Each scored submission under ``root`` predicted by the kept fit, and the summary line."""
    fitted = record.stored_fit()
    if fitted is None:
        print(
            f"plan_validation: no fit at {record.FIT_FILE}: run python "
            "benchmarks/plan_validation.py first",
            file=sys.stderr,
        )
        return 2
    if not root.is_dir():
        print(
            f"plan_validation: expected a folder of MLPerf result repositories, found no "
            f"folder {root}",
            file=sys.stderr,
        )
        return 2
    _, submissions, _ = mlperf_record.read_record([root])
    print(f"predicted by the fit on {fitted.source}")
    print(
        "| round | submitter | system | generation | chips | global batch | predicted "
        "| scored | error |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows, unpredicted = [], []
    for s in submissions:
        why = record.why_unusable(s)
        if not why and s["generation"] not in fitted.generations:
            why = f"no fit for {s['generation']}"
        if why:
            unpredicted.append(f"{s['round']} {s['submitter']} {s['system']}: {why}")
            continue
        seconds = fitted.predict(s)
        row = _row(s, seconds)
        rows.append(row)
        print(
            f"| {s['round']} | {s['submitter']} | {s['system']} | {s['generation']} "
            f"| {s['chips']:,} | {s['global_batch']:,} | {seconds / 60:.1f} min "
            f"| {s['scored_seconds'] / 60:.1f} min | {row['error']:+.0%} |"
        )
    for line in unpredicted:
        print(f"not predicted: {line}")
    print(summary(rows))
    return 0


def leave_one_out(submissions: list[dict]) -> list[float]:
    """Each submission's predicted seconds by the model fitted on all the others."""
    predicted = []
    for i, held in enumerate(submissions):
        others = submissions[:i] + submissions[i + 1 :]
        fitted = record.fit(others)
        predicted.append(fitted.predict(held))
    return predicted


def _row(s: dict, seconds: float) -> dict:
    """A prediction beside the score, its error split into convergence (the submission's own
    mean epochs against the reference) and throughput (the prediction at its own epochs)."""
    reference = record.reference_epochs(s["global_batch"])
    own = statistics.mean(s["epochs_to_target"]) if s["epochs_to_target"] else reference
    at_own_epochs = seconds * own / reference
    return {
        "round": s["round"],
        "submitter": s["submitter"],
        "system": s["system"],
        "generation": s["generation"],
        "chips": s["chips"],
        "hosts": s["hosts"],
        "global_batch": s["global_batch"],
        "scored_seconds": s["scored_seconds"],
        "predicted_seconds": seconds,
        "error": seconds / s["scored_seconds"] - 1,
        "reference_epochs": reference,
        "own_epochs": own,
        "convergence_error": reference / own - 1,
        "throughput_error": at_own_epochs / s["scored_seconds"] - 1,
    }


def summary(rows: list[dict]) -> str:
    """``within ±20%: K of N; median |error| X%``."""
    if not rows:
        return "within ±20%: 0 of 0"
    within, median = _within_and_median(rows)
    return f"within ±{WITHIN:.0%}: {within} of {len(rows)}; median |error| {median:.1%}"


def _within_and_median(rows: list[dict]) -> tuple[int, float]:
    """How many predictions are within :data:`WITHIN`, and the median absolute error."""
    errors = [abs(r["error"]) for r in rows]
    return sum(e <= WITHIN for e in errors), statistics.median(errors)


def _print_left_out(submissions: list[dict], usable: list[dict]) -> None:
    kept = {id(s) for s in usable}
    reasons: dict[str, list[str]] = {}
    for s in submissions:
        if id(s) in kept:
            continue
        why = record.why_unusable(s) or (
            f"fewer than {record.MIN_SUBMISSIONS} scored submissions of its generation"
        )
        reasons.setdefault(why, []).append(s["generation"])
    for why, generations in sorted(reasons.items()):
        counts = ", ".join(f"{g} {generations.count(g)}" for g in sorted(set(generations)))
        print(f"  not fitted: {len(generations)} ({why}): {counts}")


def _print_groups(rows: list[dict], fitted: record.RecordFit) -> None:
    # FLOPs of one ResNet-50 training image (the calibration's compiled step), read only to
    # print a generation's rate as a share of its peak.
    flops = json.loads(published.CALIBRATION_FILE.read_text())["facts"]["flops_per_image"]
    print(
        "\n| generation | submissions | chips | images/s per chip | share of peak "
        "| overhead per step | within ±20% | median abs(error) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name, g in sorted(fitted.generations.items(), key=lambda kv: -kv[1].submissions):
        mine = [r for r in rows if r["generation"] == name]
        chip = CHIPS.get(name)
        share = f"{g.images_per_second * flops / chip.peak_flops:.0%}" if chip else "—"
        within, median = _score(mine)
        print(
            f"| {name} | {len(mine)} | {g.chips[0]:,}-{g.chips[1]:,} "
            f"| {g.images_per_second:,.0f} | {share} | {g.step_overhead * 1e3:.1f} ms "
            f"| {within} | {median} |"
        )
    print("\n| scale | submissions | within ±20% | median abs(error) |\n|---|---|---|---|")
    low = 0
    for name, high in SCALES:
        mine = [r for r in rows if low < r["hosts"] <= high]
        within, median = _score(mine)
        print(f"| {name} | {len(mine)} | {within} | {median} |")
        low = high


def _score(rows: list[dict]) -> tuple[str, str]:
    if not rows:
        return "—", "—"
    within, median = _within_and_median(rows)
    return f"{within} ({within / len(rows):.0%})", f"{median:.1%}"


def _print_worst(rows: list[dict], count: int = 10) -> None:
    print(
        f"\nthe {count} worst, and how much of each error is convergence (own epochs "
        "against the reference) and how much throughput:"
    )
    print(
        "| submission | generation | chips | global batch | error | convergence "
        "| throughput |\n|---|---|---|---|---|---|---|"
    )
    for r in sorted(rows, key=lambda r: abs(r["error"]), reverse=True)[:count]:
        print(
            f"| {r['round']} {r['submitter']} {r['system']} | {r['generation']} "
            f"| {r['chips']:,} | {r['global_batch']:,} | {r['error']:+.0%} "
            f"| {r['convergence_error']:+.0%} ({r['own_epochs']:.1f} epochs, reference "
            f"{r['reference_epochs']:.1f}) | {r['throughput_error']:+.0%} |"
        )
    off = [r for r in rows if abs(r["error"]) > WITHIN]
    convergence = sum(abs(r["throughput_error"]) <= WITHIN for r in off)
    print(
        f"of the {len(off)} outside ±20%, {convergence} are within it at their own epochs "
        "(the miss is convergence, which no planner sees before the run)"
    )


def _temporal(early: list[dict], late: list[dict]) -> dict:
    fitted = record.fit(record.fittable(early))
    rows = []
    for s in late:
        if s["generation"] not in fitted.generations:
            continue
        rows.append(_row(s, fitted.predict(s)))
    new = sorted({s["generation"] for s in late} - set(fitted.generations))
    return {
        "summary": summary(rows)
        + (f" (not predicted: {', '.join(new)}, no earlier submission)" if new else ""),
        "rows": rows,
    }


def _rounds(submissions: list[dict]) -> str:
    rounds = sorted({s["round"] for s in submissions}, key=mlperf_record.round_number)
    return f"{rounds[0]}-{rounds[-1]}" if rounds else "none"
