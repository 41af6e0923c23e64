"""How far stored `jaxdist bench allreduce` results are from the cost model's prediction.

Reprices every row of one or more ``--json`` files with the link fitted in that run (its
``alpha`` and ``beta``) and the port count asked for, and prints measured time over predicted
time per algorithm and size, so a change to the model can be checked against measurements
already taken::

    python benchmarks/model_check.py benchmarks/results/allreduce_cpu_torus-4x2_in_place.json \\
        --ports 1,2 --algorithms ring,bidirectional_ring

Files written before the bench recorded the port count (all of them assumed two for the
bidirectional ring) are priced with each port count asked for just the same. Schedule options
are read from the file; a run that relied on a default that has changed since (the crossed
exchange was on by default for two hosts once) is priced with today's default. Each file is
therefore first repriced with the port count its run used and compared with the predictions it
stored: a mismatch is printed as a warning, so such rows are not mistaken for measurements
drifting from the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxdist.bench import allreduce as bench
from jaxdist.comm import cost_model


def _link(stored: dict, ports: int) -> cost_model.Link:
    return cost_model.Link(stored["alpha_s"], stored["beta_s_per_byte"], ports)


def ratios(result: dict, ports: int) -> dict[tuple[str, int], float]:
    """(algorithm, bytes) -> measured seconds over the model's seconds with ``ports``; the
    two-level schedules on the links fitted along each axis where the run recorded them."""
    link = _link(result["link"], ports)
    axis_links = None
    if "inter_link" in result:
        axis_links = cost_model.Network(
            intra=_link(result["intra_link"], ports), inter=_link(result["inter_link"], ports)
        )
    options = result.get("options", {})
    out = {}
    for row in result["rows"]:
        predicted = cost_model.predict(
            row["algorithm"],
            row["nbytes"],
            tuple(result["axis_sizes"]),
            bench.priced_on(row["algorithm"], link, axis_links),
            inter_algorithm=options.get("inter_algorithm", "ring"),
            crossed_exchange=options.get("crossed_exchange"),
        )
        out[row["algorithm"], row["nbytes"]] = row["seconds"] / predicted
    return out


def stale_predictions(result: dict) -> list[str]:
    """The rows whose stored prediction today's model, with the run's port count, does not
    reproduce (to a relative 1e-9)."""
    ports = result["link"].get("ports", 2)  # older files: the model priced two lanes at once
    repriced = ratios(result, ports)
    stale = []
    for row in result["rows"]:
        now = row["seconds"] / repriced[row["algorithm"], row["nbytes"]]
        if abs(now - row["predicted_seconds"]) > 1e-9 * row["predicted_seconds"]:
            stale.append(f"{row['algorithm']} at {bench.format_size(row['nbytes'])}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON files written by bench --json")
    parser.add_argument("--ports", default="1,2", help="port counts to price with (default 1,2)")
    parser.add_argument("--algorithms", default="all", help="comma-separated names or 'all'")
    args = parser.parse_args(argv)
    try:
        port_counts = [int(p) for p in args.ports.split(",")]
        for ports in port_counts:
            cost_model.Link(0.0, 0.0, ports)
    except ValueError as err:
        print(f"model_check: --ports {args.ports!r}: {err}", file=sys.stderr)
        return 2
    wanted = None if args.algorithms == "all" else set(args.algorithms.split(","))
    for path in args.files:
        result = json.loads(path.read_text())
        sizes = sorted({row["nbytes"] for row in result["rows"]})
        print(f"# {path.name}: mesh {result['mesh']} {tuple(result['axis_sizes'])}, "
              f"measured / predicted")  # fmt: skip
        stale = stale_predictions(result)
        if stale:
            print(f"# warning: today's model does not reproduce this run's own predictions for "
                  f"{', '.join(stale)} (a default or a formula changed since)")  # fmt: skip
        print(f"{'algorithm':<20s} {'ports':>5s} " + " ".join(
            f"{bench.format_size(s):>7s}" for s in sizes
        ))  # fmt: skip
        by_ports = {ports: ratios(result, ports) for ports in port_counts}
        for algorithm in dict.fromkeys(row["algorithm"] for row in result["rows"]):
            if wanted is not None and algorithm not in wanted:
                continue
            for ports, table in by_ports.items():
                cells = [table.get((algorithm, s)) for s in sizes]
                print(f"{algorithm:<20s} {ports:>5d} " + " ".join(
                    f"{c:7.2f}" if c is not None else f"{'-':>7s}" for c in cells
                ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
