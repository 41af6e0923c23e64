"""The published MLPerf ResNet-50 record as data: one row per result log, one per submission.

Reads MLPerf Training result repositories (``training_results_v0.7`` ... ``v3.1``, each laid out
as ``<Submitter>/results/<system>/resnet/result_<i>.txt`` beside
``<Submitter>/systems/<system>.json``) and writes, per run: round, submitter, system, division,
chips, hosts and chips per host, the accelerator as described and its generation
(:func:`jaxdist.aot.record.generation_of`), the interconnect between hosts, global and per-chip
batch, BatchNorm span, optimizer, the epoch at which its own ``eval_accuracy`` first reached
75.9% (None if it never did), the time from ``run_start`` to ``run_stop``, its status, the
log's path and a digest of its text; per submission, the score as MLPerf computes it::

    python benchmarks/mlperf_record.py --root ../shared/mlperf --out benchmarks/results/mlperf_record.json

Rules, so that every log is a row or one line saying why not:

* The system's description gives chips as ``number_of_nodes`` (some write ``number of
  nodes``, some write it as text: the first whole number is read) times
  ``accelerators_per_node``. A system with no accelerator (a CPU-only entry) is skipped.
* A log whose text is the same as an earlier round's (a submission carried over) counts once,
  in the earliest round.
* The score: ResNet-50 submissions are 5 runs; MLPerf drops the fastest and the slowest and
  takes the mean of the rest, a run that did not reach the target counting as the slowest.
  A submission with fewer than 3 runs, or with a failed run among those kept, has no score.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
from pathlib import Path

from jaxdist.aot.record import generation_of, host_network_of

TARGET = 0.759  # ResNet-50's quality target: 75.9% top-1
PREFIX = ":::MLLOG "


class LogError(ValueError):
    """A result log that cannot give a row; the message is one line naming the file."""


def parse_log(path: Path) -> dict:
    """The facts of one result log: batch, BN span, optimizer, epochs to the target, time."""
    events: dict[str, list[dict]] = {}
    text = path.read_bytes()
    for line in text.decode("utf-8", errors="replace").splitlines():
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
    accuracies = [e for e in events.get("eval_accuracy", []) if e.get("value") is not None]
    reached = [e for e in accuracies if _fraction(e["value"]) >= TARGET]
    first = min(reached, key=lambda e: e["time_ms"]) if reached else None
    stop = events["run_stop"][-1]
    status = (stop.get("metadata") or {}).get("status", "")
    return {
        "global_batch": int(events["global_batch_size"][0]["value"]),
        "bn_span": _value(events, "model_bn_span"),
        "optimizer": _value(events, "opt_name"),
        "epochs_to_target": _epoch(first) if first else None,
        "best_accuracy": max((_fraction(e["value"]) for e in accuracies), default=None),
        "seconds": (stop["time_ms"] - events["run_start"][0]["time_ms"]) / 1e3,
        # A run counts when it reached the target and did not say otherwise.
        "success": first is not None and status in ("success", ""),
        "status": status,
        "digest": hashlib.sha256(text).hexdigest()[:16],
    }


def _fraction(value: float) -> float:
    """Accuracy as a fraction (a few submitters log percent)."""
    return float(value) / 100 if float(value) > 1 else float(value)


def _epoch(event: dict) -> float:
    metadata = event.get("metadata") or {}
    return float(metadata.get("epoch_num", math.nan))


def _value(events: dict, key: str):
    return events[key][0]["value"] if key in events else None


def read_system(path: Path) -> dict:
    """Chips, hosts, the accelerator and its generation from ``systems/<system>.json``."""
    try:
        system = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise LogError(f"{path}: missing (the system's description)") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LogError(f"{path}: not a system description ({type(err).__name__}: {err})") from err
    fields = {key.replace(" ", "_").lower(): value for key, value in system.items()}
    hosts = _whole_number(fields.get("number_of_nodes"))
    per_host = _whole_number(fields.get("accelerators_per_node"))
    if hosts is None or per_host is None:
        raise LogError(
            f"{path}: no number_of_nodes and accelerators_per_node to count chips "
            f"(found {fields.get('number_of_nodes')!r} and "
            f"{fields.get('accelerators_per_node')!r})"
        )
    model = str(fields.get("accelerator_model_name", ""))
    if per_host == 0 or hosts == 0:
        raise LogError(
            f"{path}: no accelerator ({hosts} nodes x {per_host} accelerators, "
            f"{model!r}): a CPU-only system"
        )
    return {
        "division": _division(fields),
        "chips": hosts * per_host,
        "hosts": hosts,
        "chips_per_host": per_host,
        "accelerator": model,
        "generation": generation_of(model, path.stem),
        "host_network": host_network_of(str(fields.get("host_networking", ""))),
    }


def _division(fields: dict) -> str:
    """``closed`` or ``open`` (one description spells the key ``divison``, one the value
    ``close``)."""
    division = str(fields.get("division", fields.get("divison", ""))).strip().lower()
    return {"close": "closed"}.get(division, division)


def _whole_number(value) -> int | None:
    """``8``, ``"8"``, ``"16 nodes"``: the first whole number; None if there is none."""
    found = re.search(r"\d+", str(value)) if value is not None else None
    return int(found.group()) if found else None


def round_of(path: Path) -> str:
    """``v3.0`` from a path inside ``training_results_v3.0``; ``""`` if none says."""
    found = re.search(r"training_results_(v\d+\.\d+)", str(path))
    return found.group(1) if found else ""


def round_number(round_: str) -> tuple[int, ...]:
    """``"v3.0"`` -> ``(3, 0)``: rounds in the order they were held."""
    return tuple(int(n) for n in re.findall(r"\d+", round_))


def _round_key(path: Path) -> tuple:
    return (round_number(round_of(path)), str(path))


def walk(root: Path, problems: list[str], seen: set[str] | None = None) -> list[dict]:
    """A row per ResNet-50 result log under ``root``, earliest round first; what cannot be
    read, and a log already read in an earlier round (``seen`` digests), go to ``problems``."""
    seen = set() if seen is None else seen
    rows = []
    for log in sorted(root.rglob("results/*/resnet/result_*.txt"), key=_round_key):
        system_dir = log.parent.parent
        submitter_dir = system_dir.parent.parent
        try:
            facts = parse_log(log)
            if facts["digest"] in seen:
                raise LogError(f"{log}: the same log as in an earlier round (carried over)")
            system = _system_of(log, submitter_dir / "systems" / f"{system_dir.name}.json")
        except LogError as err:
            problems.append(str(err))
            continue
        seen.add(facts["digest"])
        rows.append(
            {
                "round": round_of(log),
                "submitter": submitter_dir.name,
                "system": system_dir.name,
                **system,
                **facts,
                "per_chip_batch": facts["global_batch"] / system["chips"],
                "path": str(log.relative_to(root)),
            }
        )
    return rows


def _system_of(log: Path, description: Path) -> dict:
    try:
        return read_system(description)
    except LogError as err:
        raise LogError(f"{log}: {err}") from err


def mlperf_score(runs: list[dict]) -> float | None:
    """MLPerf's score of a ResNet-50 submission: the mean of its runs' times after dropping
    the fastest and the slowest, a failed run counting as the slowest; None when a failed run
    is among those kept, or there are fewer than 3 runs."""
    times = sorted(r["seconds"] if r["success"] else math.inf for r in runs)
    if len(times) < 3:
        return None
    kept = times[1:-1]
    return None if math.inf in kept else statistics.mean(kept)


def scored(rows: list[dict]) -> list[dict]:
    """Per submission (round, submitter, system): its facts, score and its runs' epochs."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["round"], row["submitter"], row["system"]), []).append(row)
    keys = (
        "division",
        "chips",
        "hosts",
        "chips_per_host",
        "accelerator",
        "generation",
        "host_network",
        "global_batch",
        "per_chip_batch",
        "bn_span",
        "optimizer",
    )
    submissions = []
    for (round_, submitter, system), runs in sorted(groups.items()):
        epochs = [r["epochs_to_target"] for r in runs if r["success"]]
        submissions.append(
            {
                "round": round_,
                "submitter": submitter,
                "system": system,
                **{key: runs[0][key] for key in keys},
                "runs": len(runs),
                "successful_runs": sum(r["success"] for r in runs),
                "scored_seconds": mlperf_score(runs),
                "epochs_to_target": sorted(epochs),
            }
        )
    return submissions


def read_record(roots: list[Path]) -> tuple[list[dict], list[dict], list[str]]:
    """Runs, submissions and the lines saying what was skipped, of every tree in ``roots``."""
    problems: list[str] = []
    seen: set[str] = set()
    rows = [row for root in roots for row in walk(root, problems, seen)]
    return rows, scored(rows), problems


def write_table(path: Path, rows: list[dict], submissions: list[dict]) -> None:
    """The table as JSON, one run or submission a line (small diffs when a round is added)."""
    lines = [f'{{"target": {TARGET},', ' "runs": [']
    lines += [f"  {json.dumps(row)}," for row in rows]
    lines[-1] = lines[-1].rstrip(",")
    lines.append(" ],")
    lines.append(' "submissions": [')
    lines += [f"  {json.dumps(s)}," for s in submissions]
    lines[-1] = lines[-1].rstrip(",")
    lines.append(" ]}")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        nargs="+",
        required=True,
        type=Path,
        help="result repositories (or folders holding them)",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    parser.add_argument("--quiet", action="store_true", help="count the skipped logs only")
    args = parser.parse_args(argv)
    missing = [str(root) for root in args.root if not root.is_dir()]
    if missing:
        print(
            f"mlperf_record: expected folders of result repositories, found no folder "
            f"{', '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    rows, submissions, problems = read_record(args.root)
    if not args.quiet:
        for line in problems:
            print(f"mlperf_record: skipped {line}", file=sys.stderr)
    write_table(args.out, rows, submissions)
    with_score = sum(s["scored_seconds"] is not None for s in submissions)
    print(
        f"{len(rows)} runs of {len(submissions)} submissions ({with_score} scored) -> "
        f"{args.out} ({len(problems)} logs skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
