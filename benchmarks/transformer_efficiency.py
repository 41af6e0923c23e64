"""The transformer efficiency fit scored: leave-one-out over the fitted runs, and MaxText's v5e
table (kept out of the fit) predicted.

Every run of ``jaxdist/aot/data/transformer_runs.json`` with its model FLOPs utilization under
MaxText's current count (:mod:`jaxdist.aot.transformer_efficiency`); for each bfloat16 run of
the fit, the median of the others of its generation and software stack (or of its kind, TPU
or GPU, where it is the only one) as its prediction; for each v5e run, the value a plan uses::

    python benchmarks/transformer_efficiency.py --out benchmarks/results/transformer_efficiency.json

A prediction is "within" when it is within 20% (relative) of the run's utilization.
"""

from __future__ import annotations

import argparse
import json
import statistics

from jaxdist.aot import transformer_efficiency as te

TOLERANCE = 0.20


def _row(run: dict, predicted: te.Efficiency) -> dict:
    measured = te.utilization(run)
    return {
        "generation": run["generation"],
        "model": run["model"],
        "source": te.source(run),
        "chips": run["chips"],
        "per_device_batch": run["per_device_batch"],
        "measured": measured,
        "predicted": predicted.value,
        "predicted_from": predicted.describe(),
        "within": abs(predicted.value / measured - 1) <= TOLERANCE,
    }


def score(table: list[dict]) -> dict:
    """Leave-one-out rows of the fitted runs, and the held-out generations' predictions."""
    fitted = [r for r in table if r["dtype"] == "bfloat16" and te.utilization(r) is not None]
    leave_one_out = [
        _row(r, te.fitted_efficiency(r["generation"], table, leave_out=r, stack=te.software(r)))
        for r in fitted
        if r["generation"] not in te.HELD_OUT
    ]
    held_out = [
        _row(r, te.fitted_efficiency(r["generation"], table))
        for r in fitted
        if r["generation"] in te.HELD_OUT
    ]
    generations = sorted({r["generation"] for r in table} - set(te.HELD_OUT))
    return {
        "fit": {g: te.fitted_efficiency(g, table).__dict__ for g in [*generations, *te.HELD_OUT]},
        "leave_one_out": leave_one_out,
        "leave_one_out_within": sum(r["within"] for r in leave_one_out) / len(leave_one_out),
        "held_out": held_out,
        "held_out_within": sum(r["within"] for r in held_out) / len(held_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the scores as JSON here")
    args = parser.parse_args()
    result = score(te.runs())
    for generation, fit in result["fit"].items():
        print(f"{generation:>5}: {te.Efficiency(**fit).describe()}")
    print(
        f"leave-one-out: {result['leave_one_out_within']:.0%} of "
        f"{len(result['leave_one_out'])} fitted runs within {TOLERANCE:.0%}"
    )
    for row in result["leave_one_out"]:
        if not row["within"]:
            print(
                f"  outside: {row['generation']} {row['source']} {row['model']} on {row['chips']} "
                f"({row['measured']:.3f} measured, {row['predicted']:.3f} predicted)"
            )
    print(
        f"held out ({', '.join(te.HELD_OUT)}): {result['held_out_within']:.0%} of "
        f"{len(result['held_out'])} runs within {TOLERANCE:.0%}"
    )
    for row in result["held_out"]:
        ratio = row["predicted"] / row["measured"]
        print(
            f"  {row['model']} on {row['chips']}: measured {row['measured']:.3f}, "
            f"predicted {row['predicted']:.3f} ({ratio:.2f}x)"
        )
    print(
        f"median held-out ratio: "
        f"{statistics.median(r['predicted'] / r['measured'] for r in result['held_out']):.2f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
