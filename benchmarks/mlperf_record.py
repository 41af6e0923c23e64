"""The published MLPerf ResNet-50 record as data: one row per run of every submission.

Reads MLPerf Training result repositories (``training_results_v0.7`` ... ``v4.0``, each laid out
as ``<Submitter>/results/<system>/resnet/result_<i>.txt`` beside
``<Submitter>/systems/<system>.json``) and writes, per run: round, submitter, system, chips and
their model, global and per-chip batch, BatchNorm span, optimizer, the epoch at which its own
``eval_accuracy`` first reached 75.9%, the time from ``run_start`` to ``run_stop``, its status
and the log's path; per submission, the scored time as MLPerf scores it (the mean of the
successful runs after dropping the fastest and the slowest)::

    python benchmarks/mlperf_record.py --root DIR [DIR ...] --out benchmarks/results/mlperf_record.json

A log that does not parse, a run that never logs an accuracy at or above the target, or a
system without its description is skipped with one line naming the file; the rest is kept.
Logs of the ``:::MLLOG`` format are read (round v0.7 and later).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TARGET = 0.759  # ResNet-50's quality target: 75.9% top-1
PREFIX = ":::MLLOG "


class LogError(ValueError):
    """A result log that cannot give a row; the message is one line naming the file."""


def parse_log(path: Path) -> dict:
    """The facts of one result log: batch, BN span, optimizer, epochs to the target, time."""
    events: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            at = line.find(PREFIX)
            if at < 0:
                continue
            try:
                record = json.loads(line[at + len(PREFIX) :])
                events.setdefault(record["key"], []).append(record)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short; the keys below decide whether the log is usable
    if not events:
        raise LogError(f"{path}: no {PREFIX.strip()} lines (not an MLPerf v0.7+ result log)")
    for key in ("run_start", "run_stop", "global_batch_size"):
        if key not in events:
            raise LogError(f"{path}: no {key} event")
    reached = [e for e in events.get("eval_accuracy", [])
               if _fraction(e["value"]) >= TARGET]  # fmt: skip
    if not reached:
        best = max((_fraction(e["value"]) for e in events.get("eval_accuracy", [])), default=None)
        seen = "no eval_accuracy event" if best is None else f"best eval_accuracy {best:.4f}"
        raise LogError(f"{path}: never reached {TARGET:.1%} ({seen})")
    first = min(reached, key=lambda e: e["time_ms"])
    stop = events["run_stop"][-1]
    return {
        "global_batch": int(events["global_batch_size"][0]["value"]),
        "bn_span": _value(events, "model_bn_span"),
        "optimizer": _value(events, "opt_name"),
        "epochs_to_target": float(first["metadata"].get("epoch_num", float("nan"))),
        "seconds": (stop["time_ms"] - events["run_start"][0]["time_ms"]) / 1e3,
        "status": stop.get("metadata", {}).get("status", ""),
    }


def _fraction(value: float) -> float:
    """Accuracy as a fraction (a few submitters log percent)."""
    return float(value) / 100 if float(value) > 1 else float(value)


def _value(events: dict, key: str):
    return events[key][0]["value"] if key in events else None


def read_system(path: Path) -> dict:
    """Chips and their model from a submission's ``systems/<system>.json``."""
    try:
        system = json.loads(path.read_text())
        chips = int(system["number_of_nodes"]) * int(system["accelerators_per_node"])
    except FileNotFoundError as err:
        raise LogError(f"{path}: missing (the system's description)") from err
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise LogError(f"{path}: not a system description ({type(err).__name__}: {err})") from err
    return {"chips": chips, "accelerator": system.get("accelerator_model_name", "")}


def round_of(path: Path) -> str:
    """``v3.0`` from a path inside ``training_results_v3.0``; ``""`` if none says."""
    found = re.search(r"training_results_(v\d+\.\d+)", str(path))
    return found.group(1) if found else ""


def walk(root: Path, problems: list[str]) -> list[dict]:
    """A row per ResNet-50 result log under ``root``; what cannot be read goes to ``problems``."""
    rows = []
    for log in sorted(root.rglob("results/*/resnet/result_*.txt")):
        system_dir = log.parent.parent
        submitter_dir = system_dir.parent.parent
        try:
            system = read_system(submitter_dir / "systems" / f"{system_dir.name}.json")
            facts = parse_log(log)
        except LogError as err:
            problems.append(str(err))
            continue
        rows.append({
            "round": round_of(log),
            "submitter": submitter_dir.name,
            "system": system_dir.name,
            **system,
            **facts,
            "per_chip_batch": facts["global_batch"] / system["chips"],
            "path": str(log.relative_to(root)),
        })  # fmt: skip
    return rows


def scored(rows: list[dict]) -> list[dict]:
    """Per submission (round, submitter, system): MLPerf's score, the mean run time of its
    successful runs without the fastest and the slowest (all of them when fewer than 3)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["round"], row["submitter"], row["system"]), []).append(row)
    submissions = []
    for (round_, submitter, system), runs in sorted(groups.items()):
        times = sorted(r["seconds"] for r in runs if r["status"] == "success")
        kept = times[1:-1] if len(times) >= 3 else times
        submissions.append({
            "round": round_, "submitter": submitter, "system": system,
            "chips": runs[0]["chips"], "accelerator": runs[0]["accelerator"],
            "global_batch": runs[0]["global_batch"], "runs": len(runs),
            "successful_runs": len(times),
            "scored_seconds": statistics.mean(kept) if kept else None,
            "epochs_to_target": sorted(r["epochs_to_target"] for r in runs),
        })  # fmt: skip
    return submissions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", nargs="+", required=True, type=Path,
                        help="result repositories (or folders holding them)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    args = parser.parse_args(argv)
    problems: list[str] = []
    rows = [row for root in args.root for row in walk(root, problems)]
    for line in problems:
        print(f"mlperf_record: skipped {line}", file=sys.stderr)
    submissions = scored(rows)
    args.out.write_text(json.dumps({"target": TARGET, "runs": rows, "submissions": submissions},
                                   indent=1) + "\n")  # fmt: skip
    print(f"{len(rows)} runs of {len(submissions)} submissions -> {args.out} "
          f"({len(problems)} skipped)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
